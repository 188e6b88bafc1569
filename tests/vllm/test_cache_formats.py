"""vLLM's ``--block-size`` and FP8 ``--kv-cache-dtype`` through the adapter (docs/kv-cache.md).

With vLLM's own metadata and its own ``uint8`` FP8 allocation (the kit's
``make_case``): outputs against the float64 reference over the cache as it is
held (dequantised, ``stored * scale``), the cache bytes against the contract's
quantising write, the layer's ``_k_scale`` / ``_v_scale`` as vLLM sets them,
``-1`` slots included; the batch's ``page_table`` is vLLM's block table. What a
backend does not declare is refused by name, with a plugin distribution that
declares pages of 32 and float caches only, in a vLLM process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from attnhost_vllm_cpu.forward import BATCHES, CACHE_BATCHES, FP8_CACHES, ForwardCase, check
from attnhost_vllm_cpu.kit import FP8_FORMATS, make_case
from cache_scenario import PLUGIN
from distgen import make_dist
from helpers import subprocess_env
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum


def run(name: str, batch: str, kv_cache_dtype: str, dtype: torch.dtype, block_size: int = 16) -> None:
    """The engine kit's cache-format case (8 heads / 2 KV heads) through ``name``'s vLLM class: the kit's check,
    whose failure names the backend, the case and the error."""
    fcase = ForwardCase(batch, "gqa", block_size, dtype, kv_cache_dtype=kv_cache_dtype)
    check(AttentionBackendEnum[name.upper()].get_class(), fcase, f"{name}, {fcase.describe()}")


@pytest.mark.parametrize("kv_cache_dtype", FP8_CACHES)
@pytest.mark.parametrize("batch", CACHE_BATCHES)
@pytest.mark.parametrize("name", ["torch_native", "cpu_paged"])
def test_fp8_cache_in_blocks_of_16(name: str, batch: str, kv_cache_dtype: str) -> None:
    """Over vLLM's FP8 cache, block size 16, float32: every output against the float64 reference of the dequantised
    cache, every new token's bytes as the contract writes them (``-1`` rows never written). torch_native reads
    slots through req_to_token, the compiled cpu_paged walks page_table (vLLM's block table)."""
    fp8 = str(FP8_FORMATS[kv_cache_dtype]).removeprefix("torch.")
    cls = AttentionBackendEnum[name.upper()].get_class()
    if kv_cache_dtype not in cls.supported_kv_cache_dtypes:
        pytest.skip(f"{name} does not declare {fp8} in BackendCapabilities.kv_cache_dtypes")
    run(name, batch, kv_cache_dtype, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_fp8_cache_under_half_precision_models(dtype: torch.dtype) -> None:
    run("torch_native", "mixed", "fp8", dtype)


def test_fp8_saturates_and_uses_the_scales() -> None:
    """The case's scales put the format's largest value at 2 (layer 1's K at 4): its inputs beyond that are stored
    as the largest value, so a write that neither divides nor clamps cannot pass, and the check above read them."""
    case = make_case(BATCHES["mixed"], block_size=16, num_heads=8, num_kv_heads=2, kv_cache_dtype="fp8")
    assert case.scales is not None and case.scales[1][0] == 2 * case.scales[0][0]
    limit = torch.finfo(torch.float8_e4m3fn).max * case.scales[0][0]
    k_in = torch.cat([r.k_in[0] for r in case.requests if r.k_in is not None])
    k_held = torch.cat([r.k[0] for r in case.requests])
    assert bool((k_in.abs() > limit).any()) and float(k_held.abs().max()) == limit


def test_page_table_is_vllms_block_table() -> None:
    """The batch's page table is vLLM's block table (its first blocks), ``page_size`` its block size, and every
    token's slot ``page * block_size + offset``."""
    case = make_case(BATCHES["prefix_cached"], block_size=16, num_heads=4, num_kv_heads=2, kv_cache_dtype="fp8")
    cls = AttentionBackendEnum.TORCH_NATIVE.get_class()
    config = VllmConfig(cache_config=CacheConfig(cache_dtype="fp8"))
    metadata = cls.get_builder_cls()(case.spec, ["layer.0"], config, "cpu").build(0, case.metadata)
    batch, kv = metadata.batch, metadata.kv
    assert kv.page_size == 16 and kv.dtype == torch.float8_e4m3fn
    pages = batch.page_table
    assert pages.dtype == torch.int64
    for i, r in enumerate(case.requests):
        assert pages[i, : len(r.blocks)].tolist() == r.blocks
        slots = kv.req_to_token[i, : r.seq].tolist()
        assert slots == [int(pages[i, p // 16]) * 16 + p % 16 for p in range(r.seq)]


def test_float_caches_in_blocks_of_16_still_read_every_slot() -> None:
    """The float path with the page-size view: bfloat16, block size 16, rejected (``-1``) rows."""
    run("torch_native", "drafter_rejected", "auto", torch.bfloat16)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = Path(tmp_path_factory.mktemp("paged32"))
    make_dist(
        root, "paged32-attn", "1.0", {"sglang.draft_attention_backends": {"paged32": "paged32_attn"}}, modules=PLUGIN
    )
    script = Path(__file__).with_name("cache_scenario.py")
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=subprocess_env([root], {"VLLM_TARGET_DEVICE": "cpu"}),
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT: ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT: "))
    return result


WHO = "attnhost backend 'paged32' (plugin 'paged32' (distribution paged32-attn 1.0)), vLLM --attention-backend PAGED32"


def test_selector_sees_declared_page_sizes_and_cache_dtypes(refusals: dict[str, Any]) -> None:
    assert refusals["block_sizes"] == ["32"]
    assert refusals["kv_dtypes"] == ["auto", "bfloat16", "float16"]
    assert refusals["torch_native_kv_dtypes"] == ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
    assert refusals["torch_native_block_sizes"] == ["MultipleOf(1)"]
    assert refusals["ok"] == []  # 32, and 64 (vLLM splits it into kernel blocks of 32)


def test_selector_refuses_undeclared_block_size_and_fp8_by_name(refusals: dict[str, Any]) -> None:
    assert refusals["block_16"] == [
        f"{WHO}: KV-cache page size 16 (it reads page sizes 32; BackendCapabilities.page_sizes)"
    ]
    assert refusals["fp8"] == [
        f"{WHO}: an FP8 KV cache of dtype float8_e4m3fn (it reads KV caches of float32, bfloat16, float16; "
        "BackendCapabilities.kv_cache_dtypes)"
    ]


def test_builder_and_impl_refuse_by_name_with_the_way_out(refusals: dict[str, Any]) -> None:
    assert refusals["builder_32"] == "" and refusals["impl_auto"] == ""
    assert refusals["builder_16"] == (
        f"UnsupportedFeatureError: {WHO} does not support KV-cache page size 16 (it reads page sizes 32; "
        "BackendCapabilities.page_sizes), asked by vLLM as --block-size 16; run vLLM with --block-size 32 (or a "
        "multiple of one it reads) or choose another --attention-backend"
    )
    for key, vllm_name, dtype in (
        ("builder_fp8_e5m2", "fp8_e5m2", "float8_e5m2"),
        ("impl_fp8", "fp8", "float8_e4m3fn"),
    ):
        assert refusals[key] == (
            f"UnsupportedFeatureError: {WHO} does not support an FP8 KV cache of dtype {dtype} (it reads KV caches "
            f"of float32, bfloat16, float16; BackendCapabilities.kv_cache_dtypes), asked by vLLM as --kv-cache-dtype "
            f"{vllm_name}; use --kv-cache-dtype auto or choose another --attention-backend (e.g. torch_native)"
        ), refusals[key]


def test_fp8_formats_are_vllms() -> None:
    from attnhost.engines.vllm.adapter import VLLM_FP8_KV_DTYPES

    assert {name: getattr(torch, dtype) for name, dtype in VLLM_FP8_KV_DTYPES.items()} == FP8_FORMATS
