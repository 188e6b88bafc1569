"""SGLang's own dense-attention test kit, driven for one backend name (used by tests/sglang and the engine suite).

The kit (``sglang.test.kits.attention_unittest``) builds a backend by name
through SGLang's ``ATTENTION_BACKENDS`` on real ``ReqToTokenPool`` /
``MHATokenToKVPool`` / ``RadixAttention`` objects with shuffled pages and
compares it with its own reference. It expects a ``unittest.TestCase``; a
skip there would hide a missing backend, so :class:`KitCase` turns it into a
failure. Importing this module imports SGLang (install the shim first).
"""

from __future__ import annotations

import contextlib
import re
import unittest
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
    build_dense_attention_fixture,
    make_dense_cases,
    run_dense_attention_case,
)

from attnhost.dtypes import quantize_fp8

__all__ = ["DTYPES", "KitCase", "build_fixture", "dense_cases", "failure_named", "fp8_fixture", "run_case"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KitCase(unittest.TestCase):
    """The ``testcase`` the kit expects; a skip would hide a missing backend, so it fails instead."""

    def runTest(self) -> None:  # pragma: no cover - never run as a test itself
        pass

    def skipTest(self, reason: object) -> NoReturn:
        raise AssertionError(f"the kit skipped the case: {reason}")


def dense_cases(backend: str) -> list[Any]:
    """SGLang's dense cases for *backend* (the same list for every name)."""
    return list(make_dense_cases(backend))


_GREATEST = re.compile(r"Greatest absolute difference: (\S+) at index (\([^)]*\)) \(up to (\S+) allowed\)")
_MISMATCHED = re.compile(r"Mismatched elements: ([^\n]+)")


@contextlib.contextmanager
def failure_named(lead: str) -> Iterator[None]:
    """Run one of SGLang's kit cases; a numeric failure becomes one line: ``lead``, the error size, how many
    elements.

    torch's ``assert_close`` message starts with "Tensor-likes are not close!",
    which names neither the backend nor the case, and runs to several lines
    per case; a backend that fails every case would print screens of them.
    """
    try:
        yield
    except AssertionError as error:
        found = _GREATEST.search(str(error))
        if found is None:
            raise
        size, where, allowed = found.groups()
        mismatched = _MISMATCHED.search(str(error))
        count = f" ({mismatched.group(1)} elements off)" if mismatched else ""
        raise AssertionError(
            f"{lead}: max abs error {size} at {where} exceeds SGLang's tolerance ({allowed}){count}"
        ) from None


def run_case(case: Any, dtype: torch.dtype) -> None:
    """One case of SGLang's kit, as the kit runs it; a numeric failure leads with the backend, case and error size."""
    dtype_name = str(dtype).removeprefix("torch.")
    lead = f"backend {case.backend!r}, SGLang dense case {case.name!r} ({dtype_name})"
    with torch.no_grad(), failure_named(lead):
        run_dense_attention_case(KitCase(), case, device="cpu", dtype=dtype)


def build_fixture(case: Any, dtype: torch.dtype = torch.float32, **options: Any) -> Any:
    """The kit's fixture for *case* on the CPU; *options* are the kit's own (``max_context_len``, ``loc_layout``)."""
    with torch.no_grad():
        return build_dense_attention_fixture(KitCase(), case, device="cpu", dtype=dtype, **options)


#: SGLang's ``--kv-cache-dtype`` for each FP8 cache dtype.
FP8_FLAGS = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def fp8_fixture(
    case: Any,
    kv_dtype: torch.dtype,
    *,
    dtype: torch.dtype = torch.float32,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str | None = None,
    **options: Any,
) -> Any:
    """SGLang's dense-kit fixture with the cache SGLang allocates for ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``.

    The kit builds only a cache of the model's dtype, so its pool is replaced by SGLang's own
    ``MHATokenToKVPool`` of dtype *kv_dtype* (stored through ``uint8``) of the same geometry, holding the kit's
    prefix as the contract's write leaves it (``quantize_fp8``; with scale 1 exactly SGLang's own cast for
    values in range); the layer gets the scales as SGLang's weight loader sets them (``k_scale_float``), and
    the backend (*backend*, default the case's) is built again by name over the new pool, as a runner builds
    it after allocating its cache. *options* go to the kit (:func:`build_fixture`).
    """
    fixture = build_fixture(case, dtype, **options)
    runner, old = fixture.runner, fixture.runner.token_to_kv_pool
    pool = MHATokenToKVPool(
        size=old.size,
        page_size=old.page_size,
        dtype=kv_dtype,
        head_num=old.head_num,
        head_dim=old.head_dim,
        layer_num=old.layer_num,
        device=str(old.device),
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    for layer in range(old.layer_num):
        for source, target, scale in ((old.k_buffer, pool.k_buffer, k_scale), (old.v_buffer, pool.v_buffer, v_scale)):
            target[layer].copy_(quantize_fp8(source[layer], scale, kv_dtype).view(pool.store_dtype))
    runner.token_to_kv_pool = pool
    runner.kv_cache_dtype = kv_dtype
    runner.kv_cache_dtype_str = FP8_FLAGS[kv_dtype]
    fixture.forward_batch.token_to_kv_pool = pool
    attn = fixture.actual_module.attn
    attn.k_scale_float, attn.v_scale_float = float(k_scale), float(v_scale)
    fixture.backend = ATTENTION_BACKENDS[backend or case.backend](runner)
    return fixture
