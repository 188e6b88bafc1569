"""How an attnhost backend is named inside vLLM, the module that hosts its class, and the ids of vLLM's layers.

vLLM's ``--attention-backend NAME`` looks up ``AttentionBackendEnum[NAME.upper()]``,
so every attnhost name is spelled as an identifier there; each vLLM name's class
lives at ``attnhost.engines.vllm.backends.NAME`` (the value that survives a
spawned process: :class:`attnhost.engines.vllm.bridge.ClassPath`).

Each vLLM attention layer (impl, dense or MLA) gets an attnhost layer id of its own in this process
(:func:`new_layer_id`), so the KV views a builder binds per layer never mix two layers.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["BACKENDS_MODULE", "new_layer_id", "vllm_name"]

BACKENDS_MODULE = "attnhost.engines.vllm.backends"
"""The module whose ``__getattr__`` makes one adapter class per vLLM name."""

_NOT_IDENTIFIER = re.compile(r"\W")
_layer_ids = itertools.count()


def vllm_name(name: str) -> str:
    """An attnhost name spelled as vLLM's enum and ``--attention-backend NAME.upper()`` need it."""
    spelled = _NOT_IDENTIFIER.sub("_", name).upper()
    return spelled if spelled.isidentifier() else f"ATTNHOST_{spelled}"


def new_layer_id() -> int:
    """A new attnhost layer id, one per vLLM attention layer (impl) in this process."""
    return next(_layer_ids)
