"""How an attnhost backend is named inside vLLM, and the class path that survives a spawned process.

vLLM keeps a chosen backend as an ``AttentionBackendEnum`` member inside its
config, and an enum member pickles *by value*: ``(AttentionBackendEnum,
(value,))``. A spawned child (vLLM spawns once CUDA is initialised, under Ray,
with ``--numa-bind``) unpickles its config before it loads any plugin, so a
member registered at run time is unknown there and unpickling fails with
``ValueError: '<value>' is not a valid AttentionBackendEnum``.

The member's value is therefore a :class:`ClassPath`: a ``str`` (vLLM uses it
as the backend's class path) that pickles as a call to :func:`restore`. The
child runs that call while unpickling the member's value, *before* the enum
lookup: it registers attnhost's backends in the child and hands back the
registered value, so the lookup finds the member. No vLLM code is patched and
nothing depends on which plugin group loads first.

Each vLLM name gets its own class path (``attnhost.engines.vllm.backends.NAME``):
two members with one value would alias each other across the pickle.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import re

__all__ = ["BACKENDS_MODULE", "ClassPath", "class_path", "restore", "vllm_name"]

BACKENDS_MODULE = "attnhost.engines.vllm.backends"
"""The module whose ``__getattr__`` makes one adapter class per vLLM name."""

_NOT_IDENTIFIER = re.compile(r"\W")


def vllm_name(name: str) -> str:
    """An attnhost name spelled as vLLM's enum and ``--attention-backend NAME.upper()`` need it."""
    spelled = _NOT_IDENTIFIER.sub("_", name).upper()
    return spelled if spelled.isidentifier() else f"ATTNHOST_{spelled}"


class ClassPath(str):
    """The value of an attnhost member of ``AttentionBackendEnum``: a class path that re-registers on unpickling."""

    __slots__ = ()

    @property
    def engine_name(self) -> str:
        return self.rsplit(".", 1)[1]

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return restore, (str(self),)


def class_path(engine_name: str) -> ClassPath:
    return ClassPath(f"{BACKENDS_MODULE}.{engine_name}")


def restore(path: str) -> str:
    """Unpickling hook: register attnhost's backends in this process, return the registered enum value."""
    from attnhost.engines.vllm.bridge import registered_value

    return registered_value(ClassPath(path).engine_name)
