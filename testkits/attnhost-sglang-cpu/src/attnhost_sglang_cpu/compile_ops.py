"""TEST-ONLY: the ``sgl_kernel`` operators SGLang's CPU graph runner registers fake kernels for, defined as stand-ins.

``CPUGraphRunner`` (with ``--enable-torch-compile``) registers a fake implementation for about thirty of
sgl-kernel's CPU operators before it compiles the model, and ``torch.library.register_fake`` refuses an operator
nobody defined. sgl-kernel's CPU build is not on PyPI, and the test platform runs the torch paths, which call
none of them; so while the runner starts, each operator it names that does not exist is defined here with a
placeholder schema (its fake is registered and never called). Nothing here runs outside the test platform's
graph variant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["sgl_kernel_stand_ins"]

_LIBRARY: torch.library.Library | None = None
_DEFINED: set[str] = set()


def _define(name: str) -> None:
    global _LIBRARY
    namespace, _, op = name.partition("::")
    if namespace != "sgl_kernel" or op in _DEFINED or hasattr(torch.ops.sgl_kernel, op):
        return
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")  # type: ignore[no-untyped-call]
    _LIBRARY.define(f"{op}(Tensor x) -> Tensor")  # type: ignore[no-untyped-call]
    _DEFINED.add(op)


@contextlib.contextmanager
def sgl_kernel_stand_ins() -> Iterator[None]:
    """While inside, ``torch.library.register_fake("sgl_kernel::NAME")`` first defines ``NAME`` if it is missing."""
    original: Callable[..., Any] = torch.library.register_fake

    def register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(op, str):
            _define(op)
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        yield
    finally:
        torch.library.register_fake = original
