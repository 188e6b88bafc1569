"""How an attnhost backend is named inside vLLM, and the module that hosts its class.

vLLM's ``--attention-backend NAME`` looks up ``AttentionBackendEnum[NAME.upper()]``,
so every attnhost name is spelled as an identifier there; each vLLM name's class
lives at ``attnhost.engines.vllm.backends.NAME`` (the value that survives a
spawned process: :class:`attnhost.engines.vllm.bridge.ClassPath`).

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import re

__all__ = ["BACKENDS_MODULE", "vllm_name"]

BACKENDS_MODULE = "attnhost.engines.vllm.backends"
"""The module whose ``__getattr__`` makes one adapter class per vLLM name."""

_NOT_IDENTIFIER = re.compile(r"\W")


def vllm_name(name: str) -> str:
    """An attnhost name spelled as vLLM's enum and ``--attention-backend NAME.upper()`` need it."""
    spelled = _NOT_IDENTIFIER.sub("_", name).upper()
    return spelled if spelled.isidentifier() else f"ATTNHOST_{spelled}"
