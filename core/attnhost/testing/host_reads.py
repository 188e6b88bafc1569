"""A device that refuses host reads, on the CPU: proof that a step never waits on the device.

On a GPU, reading a device tensor's values on the host (``.tolist()``, ``.item()``, ``bool(t)``, a shape that
depends on the data, as ``nonzero()`` has) is a stream synchronisation: the host waits until the device has
caught up, so the engine can no longer schedule the next batch while this one runs, and a captured graph cannot
contain it at all. On a CPU every such read is free, so nothing shows it. :class:`DeviceOnly` shows it: a tensor
subclass whose values, inside :func:`no_host_reads`, may be computed on but not read, and whose results stay
``DeviceOnly``. The kit and the engine tests wrap what an engine would hold on its device in it and run whole
steps; any read raises :class:`HostReadError` naming the operation, with the reader in the traceback.

Hand-written because no library offers it: ``torch.cuda.set_sync_debug_mode`` needs a GPU, and a
``__torch_function__`` subclass is the one interposition point that sees both methods and free functions.
Device-side asserts (``torch._assert_async``) are allowed: on a GPU they fail the step without a sync.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["DeviceOnly", "HostReadError", "device_only", "no_host_reads"]


class HostReadError(AssertionError):
    """A device tensor's values were read on the host inside a step (a stream synchronisation on a GPU)."""


_state = threading.local()

_READS: dict[Callable[..., Any], str] = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.item: "Tensor.item()",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__index__: "a tensor used as a Python index (__index__)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__complex__: "complex(tensor)",
    torch.Tensor.cpu: "Tensor.cpu()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "numpy's __array__",
    torch.equal: "torch.equal() (a Python bool)",
    torch.Tensor.equal: "Tensor.equal() (a Python bool)",
    torch.allclose: "torch.allclose() (a Python bool)",
    torch.Tensor.allclose: "Tensor.allclose() (a Python bool)",
    torch.nonzero: "torch.nonzero() (a shape that depends on the data)",
    torch.Tensor.nonzero: "Tensor.nonzero() (a shape that depends on the data)",
    torch.argwhere: "torch.argwhere() (a shape that depends on the data)",
    torch.masked_select: "torch.masked_select() (a shape that depends on the data)",
    torch.Tensor.masked_select: "Tensor.masked_select() (a shape that depends on the data)",
    torch.unique: "torch.unique() (a shape that depends on the data)",
    torch.Tensor.unique: "Tensor.unique() (a shape that depends on the data)",
    torch.unique_consecutive: "torch.unique_consecutive() (a shape that depends on the data)",
}


def _forbidden() -> bool:
    return bool(getattr(_state, "depth", 0))


def _data_dependent(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The name of a read that is not one of ``_READS``' plain methods: boolean-mask indexing, and
    ``repeat_interleave`` by a tensor without ``output_size`` (both size their result from the data)."""
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
        index = args[1]
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            return "indexing with a boolean mask (a shape that depends on the data)"
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave() by a tensor without output_size (a shape that depends on the data)"
    return None


class DeviceOnly(torch.Tensor):
    """A tensor whose values may be computed on but not read on the host inside :func:`no_host_reads`."""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _forbidden():
            what = _READS.get(func) or _data_dependent(func, args, kwargs)
            if what is not None:
                raise HostReadError(
                    f"{what} read a device tensor on the host inside a step: on a GPU that is a stream "
                    "synchronisation, and a captured graph cannot hold it (docs/graphs.md)"
                )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return torch._tensor._convert(result, cls)  # type: ignore[no-untyped-call]


def device_only(tensor: torch.Tensor) -> DeviceOnly:
    """``tensor``'s storage as a :class:`DeviceOnly` (no copy: writes through it are writes to ``tensor``)."""
    return tensor.as_subclass(DeviceOnly)


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Inside, reading a :class:`DeviceOnly` on the host raises :class:`HostReadError`; outside, it is a tensor."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
