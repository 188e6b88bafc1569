"""The dtypes the contract computes and caches in, the sizes it accepts, and the FP8 quantising write a cache of an
FP8 dtype stores (docs/kv-cache.md): shared by the host's pool, the runner and backends that write FP8 caches."""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPES", "check_size", "float_dtype", "quantize_fp8", "resolve_kv_cache_dtype"]


def check_size(owner: str, name: str, value: object) -> None:
    """Refuse a size that is not a positive ``int``, naming it: a float or 0 would fail far from its cause."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def float_dtype(owner: str, dtype: object) -> torch.dtype:
    """A floating-point torch dtype, from one or its name: an integer KV cache would make attention all zeros."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"{owner}: dtype {dtype!r} is not a torch dtype; use e.g. torch.float32 or 'bfloat16'")
    if not resolved.is_floating_point:
        raise ValueError(
            f"{owner}: dtype {str(resolved).removeprefix('torch.')} is not a floating-point dtype; "
            "attention and its KV cache need one (float32, bfloat16, float16)"
        )
    return resolved


FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 cache formats (``attnhost.backend.FP8_KV_DTYPES`` by name)."""


def resolve_kv_cache_dtype(owner: str, dtype: object) -> torch.dtype:
    """A KV cache's dtype: a float one (:func:`float_dtype`) or one of :data:`FP8_DTYPES`; the other 8-bit floats
    (``*_fnuz``, ``e8m0``) are refused, as no engine's cache here stores them."""
    resolved = float_dtype(owner, dtype)
    if resolved.itemsize == 1 and resolved not in FP8_DTYPES:
        raise ValueError(
            f"{owner}: KV-cache dtype {str(resolved).removeprefix('torch.')} is not one the contract knows; "
            "an FP8 cache is float8_e4m3fn or float8_e5m2"
        )
    return resolved


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The contract's quantising write (docs/kv-cache.md): ``saturate(x / scale)`` cast to ``dtype``, computed in
    float32, saturate clamping to ``±finfo(dtype).max``. Clamping first makes overflow the largest finite value in
    both formats (a bare cast gives ``inf`` in e5m2), and leaves NaN a NaN."""
    limit = torch.finfo(dtype).max
    scaled = x.to(torch.float32)
    if scale != 1.0:
        scaled = scaled / scale
    return scaled.clamp(-limit, limit).to(dtype)
