"""KV caches as production runs them: FP8 with per-layer scales, and pages larger than one token.

The contract (layer scales, declared cache dtypes and page sizes, the quantising write, the page table), attnhost's
own runner and pool, ``torch_native`` reading both, and the conformance kit catching a backend that ignores the
scales or reads pages wrongly, naming the mistake.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

torch = pytest.importorskip("torch")  # the py312/py313 envs have no torch

import attnhost
from attnhost import (
    AttentionBackend,
    AttentionLayer,
    BackendCapabilities,
    BackendSpec,
    ForwardMode,
    KVPool,
    ModelRunner,
    ServerArgs,
)
from attnhost.dtypes import quantize_fp8
from attnhost.errors import UnsupportedFeatureError
from attnhost.forward_batch import ForwardBatch
from attnhost.host import get_registry
from attnhost.testing import BackendConformance
from attnhost.testing.reference import cache_values, reference_attention, reference_request_attention
from attnhost_builtin.torch_native import TorchNativeAttnBackend

pytestmark = pytest.mark.torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# -- the contract's facts ------------------------------------------------------------------


def test_layer_scales_default_to_one_and_refuse_what_no_cache_can_use() -> None:
    layer = AttentionLayer(0, 8, 2, 64)
    assert (layer.k_scale, layer.v_scale) == (1.0, 1.0)
    assert AttentionLayer(0, 8, 2, 64, k_scale=2, v_scale=0.5).k_scale == 2.0
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="k_scale must be a finite number > 0"):
            AttentionLayer(0, 8, 2, 64, k_scale=bad)


def test_capabilities_declare_cache_dtypes_and_page_sizes() -> None:
    plain = BackendCapabilities()
    assert plain.kv_cache_dtypes is None and plain.page_sizes is None
    assert plain.cache_refusal(kv_dtype="bfloat16", page_size=128) is None
    assert plain.cache_refusal(kv_dtype="float8_e4m3fn") == (
        "an FP8 KV cache of dtype float8_e4m3fn (it reads KV caches of float32, bfloat16, float16; "
        "BackendCapabilities.kv_cache_dtypes)"
    )
    fp8 = BackendCapabilities(dtypes=("bfloat16",), kv_cache_dtypes=("bfloat16", "float8_e4m3fn"), page_sizes=[16])
    assert fp8.page_sizes == (16,)
    assert fp8.refusal(dtype="bfloat16", head_dim=64, kv_dtype="float8_e4m3fn", page_size=16) is None
    assert fp8.refusal(dtype="bfloat16", head_dim=64, kv_dtype="float8_e5m2") == (
        "an FP8 KV cache of dtype float8_e5m2 (it reads KV caches of bfloat16, float8_e4m3fn; "
        "BackendCapabilities.kv_cache_dtypes)"
    )
    assert fp8.refusal(dtype="bfloat16", head_dim=64, page_size=1) == (
        "KV-cache page size 1 (it reads page sizes 16; BackendCapabilities.page_sizes)"
    )
    for bad in ("float8_e4m3fn", (), ("",), (1,)):
        with pytest.raises(ValueError, match="kv_cache_dtypes must be dtype names"):
            BackendCapabilities(kv_cache_dtypes=bad)  # type: ignore[arg-type]
    for bad_pages in (16, (), (0,), (True,), ("16",)):
        with pytest.raises(ValueError, match="page_sizes must be positive integers"):
            BackendCapabilities(page_sizes=bad_pages)  # type: ignore[arg-type]


def test_server_args_take_sglangs_cache_flags() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--page-size", "16"]))
    assert (args.kv_cache_dtype, args.page_size) == ("fp8_e4m3", 16)
    assert (ServerArgs().kv_cache_dtype, ServerArgs().page_size) == ("auto", 1)
    with pytest.raises(ValueError, match="invalid kv_cache_dtype 'fp8'; choose from: auto, fp8_e4m3, fp8_e5m2"):
        ServerArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="invalid page_size 0"):
        ServerArgs(page_size=0)


# -- the quantising write ------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_the_fp8_write_is_saturate_of_x_over_scale_and_the_read_is_stored_times_scale(fp8: Any) -> None:
    pool = KVPool(1, 8, 1, 4, max_requests=1, max_context_len=8, dtype=fp8)
    top = torch.finfo(fp8).max
    k = torch.tensor([[[1.0, -3.0, 1e9, -1e9]], [[0.25, top * 0.5, top * 0.75, -top * 0.6]]])
    v = k.flip(0).clone()
    k_before, v_before = k.clone(), v.clone()
    pool.set_kv(0, torch.tensor([5, 2]), k, v, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # the caller's tensors are left alone
    stored = pool.k_buffer(0)[torch.tensor([5, 2])]
    expected = (k / 0.5).clamp(-top, top).to(fp8)
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert stored[0, 0, 2].float() == top and stored[0, 0, 3].float() == -top  # saturated, never inf or NaN
    assert bool(torch.isfinite(pool.v_buffer(0).float()).all())
    values = cache_values(pool.k_buffer(0), 0.5)
    assert values.dtype == torch.float64 and float(values[5, 0, 2]) == top * 0.5
    assert torch.equal(quantize_fp8(k, 0.5, fp8).view(torch.uint8), expected.view(torch.uint8))


def test_a_float_cache_ignores_the_scales_as_the_engines_do() -> None:
    pool = KVPool(1, 4, 1, 2, max_requests=1, max_context_len=4, dtype=torch.bfloat16)
    k = torch.tensor([[[3.0, -5.0]]])
    pool.set_kv(0, torch.tensor([1]), k, k, k_scale=0.25, v_scale=8.0)
    assert torch.equal(pool.k_buffer(0)[1].float(), k[0]) and torch.equal(pool.v_buffer(0)[1].float(), k[0])


def test_a_pool_refuses_8_bit_floats_the_contract_does_not_know() -> None:
    with pytest.raises(ValueError, match="float8_e4m3fnuz is not one the contract knows"):
        KVPool(1, 4, 1, 2, max_requests=1, max_context_len=4, dtype=torch.float8_e4m3fnuz)


# -- pages ---------------------------------------------------------------------------------


def test_pages_are_filled_in_order_and_the_page_table_is_built_once_per_batch() -> None:
    runner = ModelRunner(ServerArgs(attention_backend="torch_native", page_size=16), num_slots=1024)
    pool = runner.kv_pool
    assert pool.page_size == 16
    a, b = runner.new_request(), runner.new_request()
    runner.prepare_batch(ForwardMode.EXTEND, [(a, 0, 20), (b, 0, 5)])
    batch = runner.prepare_batch(ForwardMode.EXTEND, [(a, 20, 30), (b, 5, 12)])
    for request, length in ((a, 50), (b, 17)):
        slots = pool.req_to_token[request, :length]
        positions = torch.arange(length)
        assert torch.equal(slots % 16, positions % 16)  # offset within the page = position within the page
        pages = slots // 16
        assert torch.equal(pages, pages[positions // 16 * 16])  # one page per 16 positions
        assert len(set(pages.tolist())) == -(-length // 16)
    table = batch.page_table
    assert table is batch.page_table  # cached on the batch: no layer rebuilds it
    assert tuple(table.shape) == (2, 4)
    assert table[0].tolist() == (pool.req_to_token[a, :64:16] // 16).tolist()
    assert table[1, :2].tolist() == (pool.req_to_token[b, :17:16] // 16).tolist()
    assert pool.available_slots == pool.num_slots - 16 * 6


def _branches(pool: KVPool, parent: int, prefix: int, count: int) -> list[int]:
    """Draft branches as the kit makes them: request rows that copy the parent's prefix slots."""
    rows = []
    for _ in range(count):
        row = pool.alloc_request()
        pool.req_to_token[row, :prefix] = pool.req_to_token[parent, :prefix]
        rows.append(row)
    return rows


@pytest.mark.parametrize("together", [True, False], ids=["one-batch", "parent-first"])
def test_branches_sharing_a_partly_filled_page_each_get_their_own_slots(together: bool) -> None:
    """Three branches and the parent's next token all got slot 6 of the parent's second page (page size 4), so
    each branch attended to the others' K/V; the first to extend the page fills it, the others copy it."""
    pool = KVPool(1, 64, 2, 16, max_requests=8, max_context_len=16, page_size=4)
    layer = AttentionLayer(0, 4, 2, 16)
    backend = TorchNativeAttnBackend()
    parent = pool.alloc_request()
    prefill = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(parent, 0, 6)])
    backend.init_forward_metadata(prefill)
    backend.forward(torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16), layer, prefill)
    requests = [parent, *_branches(pool, parent, 6, 3)]
    batches = (
        [ForwardBatch.prepare(pool, ForwardMode.DECODE, [(r, 6, 1) for r in requests])]
        if together
        else [ForwardBatch.prepare(pool, ForwardMode.DECODE, [(r, 6, 1)]) for r in requests]
    )
    for batch in batches:
        backend.init_forward_metadata(batch)
        n = batch.batch_size
        q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
        out = backend.forward(q, k, v, layer, batch)
        torch.testing.assert_close(out.double(), reference_attention(q, layer, batch), atol=1e-5, rtol=1e-5)
    written = [int(pool.req_to_token[r, 6]) for r in requests]
    assert len(set(written)) == 4, f"new tokens share slots: {written}"
    for r in requests:  # every row keeps page alignment and reads the parent's prefix K/V
        slots = pool.req_to_token[r, :7]
        assert torch.equal(slots % 4, torch.arange(7) % 4), slots.tolist()
        assert torch.equal(pool.k_buffer(0)[slots[:6]], pool.k_buffer(0)[pool.req_to_token[parent, :6]])


def test_a_paged_allocation_that_does_not_fit_takes_nothing() -> None:
    runner = ModelRunner(ServerArgs(attention_backend="torch_native", page_size=64), num_slots=200)
    assert runner.kv_pool.num_slots == 192  # whole pages only
    request = runner.new_request()
    with pytest.raises(attnhost.KVPoolFullError, match="4 pages of 64 token slots, 3 of 3 free"):
        runner.prepare_batch(ForwardMode.EXTEND, [(request, 0, 193)])
    assert runner.kv_pool.available_pages == 3


# -- the runner refuses what its backend does not declare ------------------------------------


class _Plain(AttentionBackend):
    """Reads float caches only, in pages of 16 only."""

    capabilities = BackendCapabilities(page_sizes=(16,))

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return q


class _PlainPlugin:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="plain16", factory=_Plain, description="float caches in pages of 16")]


@pytest.fixture
def plain16() -> None:
    attnhost.register_plugin(_PlainPlugin(), name="plain16-plugin")


@pytest.mark.usefixtures("plain16")
def test_the_runner_refuses_an_fp8_cache_or_page_size_its_backend_does_not_declare_by_name() -> None:
    with pytest.raises(UnsupportedFeatureError) as caught:
        ModelRunner(ServerArgs(attention_backend="plain16", kv_cache_dtype="fp8_e4m3", page_size=16))
    message = str(caught.value)
    assert message.startswith("target runner: attention backend 'plain16' from plugin 'plain16-plugin'"), message
    assert "cannot read an FP8 KV cache of dtype float8_e4m3fn (it reads KV caches of float32, bfloat16, " in message
    with pytest.raises(UnsupportedFeatureError, match=r"cannot read KV-cache page size 1 \(it reads page sizes 16;"):
        ModelRunner(ServerArgs(attention_backend="plain16"))
    ModelRunner(ServerArgs(attention_backend="plain16", page_size=16))  # what it declares builds


def test_torch_native_declares_fp8_caches_and_any_page_size() -> None:
    capabilities = TorchNativeAttnBackend.capabilities
    assert capabilities.page_sizes is None
    assert capabilities.kv_cache_dtypes is not None
    assert {"float8_e4m3fn", "float8_e5m2", "float32", "bfloat16", "float16"} <= set(capabilities.kv_cache_dtypes)


# -- torch_native over both, variants included --------------------------------------------


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_torch_native_reads_an_fp8_cache_in_pages_in_a_windowed_soft_capped_layer(kv: str) -> None:
    runner = ModelRunner(
        ServerArgs(attention_backend="torch_native", kv_cache_dtype=kv, page_size=16),
        num_layers=1,
        head_dim=32,
        num_slots=512,
        dtype=torch.bfloat16,
    )
    layer = AttentionLayer(0, 8, 2, 32, sliding_window_size=9, logit_cap=30.0, k_scale=0.01, v_scale=0.02)
    generator = torch.Generator().manual_seed(3)
    request = runner.new_request()
    for mode, spec in ((ForwardMode.EXTEND, (request, 0, 40)), (ForwardMode.DECODE, (request, 40, 1))):
        batch = runner.prepare_batch(mode, [spec])
        n = batch.num_new_tokens
        q, k, v = (torch.randn(n, h, 32, generator=generator).to(torch.bfloat16) for h in (8, 2, 2))
        with torch.no_grad(), runner.forward_context() as backend:
            out = backend.forward(q, k, v, layer, batch)
        expected = reference_attention(q, layer, batch)  # over the dequantised cache
        assert float((out.double() - expected).abs().max()) < 2e-2


# -- the conformance kit catches the cache-format mistakes -----------------------------------


class IgnoresScale(TorchNativeAttnBackend):
    """Writes the FP8 cache correctly, then reads it as if its scales were 1."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):  # type: ignore[no-untyped-def]
        if save_kv_cache:
            forward_batch.kv_pool.set_kv(
                layer.layer_id, forward_batch.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale
            )
        unscaled = dataclasses.replace(layer, k_scale=1.0, v_scale=1.0)
        return super().forward_extend(q, k, v, unscaled, forward_batch, False, sinks)


class PageNumberAsSlot(AttentionBackend):
    """Reads token p of a request at ``page_table[i, p // page_size] + p % page_size``: the page number taken for
    its first slot (right with token slots, wrong with pages)."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        fb, pool = forward_batch, forward_batch.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        size, table, out = pool.page_size, fb.page_table, torch.empty_like(q)
        for i in range(fb.batch_size):
            start, new, seq = fb.extend_start_loc_cpu[i], fb.extend_seq_lens_cpu[i], fb.seq_lens_cpu[i]
            positions = torch.arange(seq)
            slots = table[i, positions // size] + positions % size
            out[start : start + new] = reference_request_attention(
                q[start : start + new],
                pool.k_buffer(layer.layer_id)[slots],
                pool.v_buffer(layer.layer_id)[slots],
                prefix_len=fb.prefix_lens_cpu[i],
                scaling=layer.scaling,
            ).to(q.dtype)
        return out


class _MistakesPlugin:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(name="ignores_scale", factory=IgnoresScale, description="reads FP8 without its scales"),
            BackendSpec(name="page_as_slot", factory=PageNumberAsSlot, description="reads pages wrongly"),
        ]


class _Kit(BackendConformance):
    backend_name = "torch_native"


def _kit(name: str, request: pytest.FixtureRequest) -> _Kit:
    kit = _Kit()
    kit.name, kit.entry = name, get_registry().entry(name)
    kit._generator, kit._pytest_config = torch.Generator().manual_seed(0), request.config
    return kit


def _kit_failure(case: Any, *args: Any) -> str:
    with pytest.raises(pytest.fail.Exception) as caught:
        case(*args)
    return str(caught.value)


def test_the_kit_names_a_backend_that_ignores_the_fp8_scales(request: pytest.FixtureRequest) -> None:
    attnhost.register_plugin(_MistakesPlugin(), name="cache-mistakes")
    message = _kit_failure(_kit("ignores_scale", request).test_fp8_kv_cache, "float8_e4m3fn")
    assert "float8_e4m3fn cache, float32 model" in message and "exceeds 1e-05" in message, message
    assert "the output matches attention over the FP8 cache's stored values, k_scale and v_scale not applied" in (
        message
    ), message
    assert "read stored.to(float32) * layer.k_scale" in message, message


def test_the_kit_names_a_backend_that_reads_pages_wrongly(request: pytest.FixtureRequest) -> None:
    attnhost.register_plugin(_MistakesPlugin(), name="cache-mistakes")
    kit = _kit("page_as_slot", request)
    kit.test_paged_cache(1)  # with token slots a page number is a slot number: it passes
    message = _kit_failure(kit.test_paged_cache, 16)
    assert message.startswith("paged cache (page size 16): "), message
    assert "(a page number used as a slot number)" in message, message
    assert "multiply the page number by kv_pool.page_size" in message, message


class Pages16(TorchNativeAttnBackend):
    """torch_native's kernels, declaring pages of 16 only: correct, and an engine runs it on pages of 16 only."""

    capabilities = dataclasses.replace(TorchNativeAttnBackend.capabilities, page_sizes=(16,))


class _Pages16Plugin:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="pages16", factory=Pages16, description="pages of 16 only")]


PAGED_KIT_CASES = (
    "test_extend_without_prefix",
    "test_extend_with_cached_prefix",
    "test_decode",
    "test_batch_of_requests_with_different_lengths",
    "test_target_verify_tree",
    "test_kv_lands_in_the_right_cache_slots",
    "test_save_kv_cache_false_neither_writes_nor_uses_k_v",
    "test_idle_batch_gives_an_empty_output",
    "test_variant_window_and_sinks",
    "test_mla_extend",
    "test_mla_idle_batch",
)


@pytest.mark.parametrize("case", PAGED_KIT_CASES)
def test_the_kit_runs_a_backend_that_declares_only_pages_of_16_on_pages_of_16(
    case: str, request: pytest.FixtureRequest
) -> None:
    """Every case built its runner at page size 1, which the runner refuses for such a backend: a correct
    backend failed 39 cases. Each now runs at a page size the backend declares."""
    attnhost.register_plugin(_Pages16Plugin(), name="pages16-plugin")
    kit = _kit("pages16", request)
    assert kit._runner().kv_pool.page_size == 16
    getattr(kit, case)()


def test_the_kit_names_a_write_that_does_not_divide_by_the_scale(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = KVPool.set_kv

    def unscaled(self, layer_id, loc, k, v, k_scale=1.0, v_scale=1.0):  # type: ignore[no-untyped-def]
        real(self, layer_id, loc, k, v)

    monkeypatch.setattr(KVPool, "set_kv", unscaled)
    message = _kit_failure(_kit("torch_native", request).test_fp8_kv_cache, "float8_e5m2")
    assert "layer 0's K at out_cache_loc is not what the cache's write leaves (float8_e5m2 cache)" in message, message
    assert "divide by layer.k_scale before the cast (stored = saturate(x / scale))" in message, message
