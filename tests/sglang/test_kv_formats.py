"""SGLang's ``--page-size`` and ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2`` caches reach attnhost backends as the
contract says (docs/kv-cache.md), on SGLang's own pools, batches and ``RadixAttention``.

Pages: SGLang's dense kit lays a batch out in pages (shuffled, or interleaved between requests); the adapter's
cache view reports the page size, and ``ForwardBatch.page_table`` must name, for every token, the page its slot
is in. FP8: SGLang's own ``MHATokenToKVPool`` in float8 (stored through ``uint8``, test kit's ``fp8_fixture``);
the adapter's write must leave exactly the contract's bytes (divided by the layer's scale, saturated), never
touch the caller's K/V, and the output must equal SGLang's own ``torch_native`` on the same cache (scale 1, the
only scale that backend reads) and attnhost's float64 reference over the dequantised cache (any scale).
Refusals: a real installed plugin distribution declaring page size 1 and no FP8 is refused by name.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.dense import build_fixture, fp8_fixture  # noqa: E402
from distgen import make_dist  # noqa: E402
from helpers import GROUP  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import DenseAttentionCase  # noqa: E402

from attnhost import UnsupportedFeatureError  # noqa: E402
from attnhost.backend import capabilities_of  # noqa: E402
from attnhost.dtypes import quantize_fp8  # noqa: E402
from attnhost.engines.sglang.adapter import SGLangAdapterBackend  # noqa: E402
from attnhost.forward_batch import ForwardBatch  # noqa: E402
from attnhost.testing.reference import reference_request_attention  # noqa: E402

OURS = "attnhost_torch_native"
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


def _case(page: int, mode: ForwardMode, backend: str = OURS) -> DenseAttentionCase:
    """Prefixes ending inside, at the end of and across pages; an extend also opens new pages."""
    prefix = (page - 2, 0, 2 * page + 3) if mode is ForwardMode.EXTEND else (page - 1, page, 3 * page + 5)
    return DenseAttentionCase(
        name=f"page{page}-{mode.name.lower()}",
        backend=backend,
        forward_mode=mode,
        num_heads=4,
        num_kv_heads=2,
        page_size=page,
        prefix_lens=prefix,
        extend_lens=(5, page + 3, 1) if mode is ForwardMode.EXTEND else (),
    )


MODES = [pytest.param(ForwardMode.EXTEND, id="extend"), pytest.param(ForwardMode.DECODE, id="decode")]


def _fixture(case: DenseAttentionCase, **options: Any) -> Any:
    """The kit's fixture with room for four pages per request (the kit's default context is 64 tokens)."""
    return build_fixture(case, max_context_len=4 * case.page_size + 64, **options)


def _qkv(fixture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    attn = fixture.actual_module.attn
    q, k, v = fixture.actual_module.project_qkv(fixture.input_hidden)
    return q, k.view(-1, attn.tp_k_head_num, attn.head_dim), v.view(-1, attn.tp_k_head_num, attn.head_dim)


# -- pages ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["shuffled_pages", "interleaved_pages"])
@pytest.mark.parametrize("page", [16, 64])
def test_the_page_table_names_every_tokens_page(page: int, layout: str, mode: ForwardMode) -> None:
    """Every token's slot is ``page_table[i, p // P] * P + p % P``; the output is the float64 reference's."""
    fixture = _fixture(_case(page, mode), loc_layout=layout)
    adapter = fixture.backend
    assert isinstance(adapter, SGLangAdapterBackend)
    q, k, v = _qkv(fixture)
    with torch.no_grad():
        adapter.init_forward_metadata(fixture.forward_batch)
        out = adapter.forward(q, k, v, fixture.actual_module.attn, fixture.forward_batch)
    batch = adapter._batch
    assert isinstance(batch, ForwardBatch)
    assert batch.kv_pool.page_size == page == fixture.runner.token_to_kv_pool.page_size
    table, slots = batch.page_table, fixture.runner.req_to_token_pool.req_to_token
    for i, seq_len in enumerate(batch.seq_lens_cpu):
        positions = torch.arange(seq_len)
        expected = slots[int(batch.req_pool_indices[i]), :seq_len].to(torch.int64)
        assert torch.equal(table[i, positions // page] * page + positions % page, expected), (i, layout)
    k_cache, v_cache = _stored(fixture)
    loc = fixture.forward_batch.out_cache_loc
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)  # the write, before it is read back
    attn = fixture.actual_module.attn
    expected_out = _reference(
        fixture, q.view(-1, attn.tp_q_head_num, attn.head_dim), k_cache.double(), v_cache.double()
    )
    torch.testing.assert_close(out.double().view_as(expected_out), expected_out, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [16, 64])
def test_a_paged_batch_computes_the_same_as_sglangs_torch_native(page: int, mode: ForwardMode) -> None:
    fixture = _fixture(_case(page, mode))
    outputs = [_forward(fixture, backend) for backend in (OURS, "torch_native")]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def _forward(fixture, name: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """*name*'s attention on the fixture's batch, built by name over its runner, writing its new K/V."""
    backend = ATTENTION_BACKENDS[name](fixture.runner)
    q, k, v = _qkv(fixture)
    with torch.no_grad():
        backend.init_forward_metadata(fixture.forward_batch)
        out: torch.Tensor = backend.forward(q, k, v, fixture.actual_module.attn, fixture.forward_batch)
    return out


# -- FP8 --------------------------------------------------------------------------------------------------------


def _stored(fixture) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    pool = fixture.runner.token_to_kv_pool
    return pool.k_buffer[0].clone(), pool.v_buffer[0].clone()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_dtype", FP8)
def test_an_fp8_cache_computes_and_stores_as_sglangs_torch_native(kv_dtype: torch.dtype, mode: ForwardMode) -> None:
    """Scale 1 (SGLang's default, and the only one its torch_native reads): the same bytes written, the same
    output; and FP8 changed the output against the float cache's (the check is not vacuous)."""
    outputs, stores = [], []
    for name in (OURS, "torch_native"):
        fixture = fp8_fixture(_case(16, mode, "torch_native"), kv_dtype, backend=name, max_context_len=128)
        if name == OURS:
            assert fixture.backend._kv.dtype == kv_dtype
        q, k, v = _qkv(fixture)
        with torch.no_grad():
            fixture.backend.init_forward_metadata(fixture.forward_batch)
            outputs.append(fixture.backend.forward(q, k, v, fixture.actual_module.attn, fixture.forward_batch))
        stores.append(_stored(fixture))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*stores, strict=True))
    plain = _forward(_fixture(_case(16, mode, "torch_native")), OURS)
    assert (plain - outputs[0]).abs().max() > 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_dtype", FP8)
def test_an_fp8_cache_with_scales_is_written_and_read_as_the_contract_says(
    kv_dtype: torch.dtype, mode: ForwardMode
) -> None:
    """Scales 4 and 1/4 from the layer (SGLang's ``k_scale_float`` / ``v_scale_float``) reach the write and the
    read: the new slots hold ``saturate(x / scale)``, the caller's K/V stay as they were (SGLang's pool would
    divide them in place), and the output is attnhost's float64 reference over ``stored * scale``; a value
    beyond the format's range (the kit's K times 1e5) is stored saturated, not as inf."""
    k_scale, v_scale = 4.0, 0.25
    fixture = fp8_fixture(
        _case(16, mode, "torch_native"), kv_dtype, k_scale=k_scale, v_scale=v_scale, backend=OURS, max_context_len=128
    )
    layer = fixture.backend._layer(fixture.actual_module.attn)
    assert (layer.k_scale, layer.v_scale) == (k_scale, v_scale)
    q, k, v = _qkv(fixture)
    k[0, 0, :2] = torch.tensor([1e5 * k_scale, -1e5 * k_scale])  # beyond both formats' largest finite value
    k_before, v_before = k.clone(), v.clone()
    batch, attn = fixture.forward_batch, fixture.actual_module.attn
    with torch.no_grad():
        fixture.backend.init_forward_metadata(batch)
        out = fixture.backend.forward(q, k, v, attn, batch)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    k_store, v_store = _stored(fixture)
    loc = batch.out_cache_loc
    assert torch.equal(k_store[loc], quantize_fp8(k, k_scale, kv_dtype).view(torch.uint8))
    assert torch.equal(v_store[loc], quantize_fp8(v, v_scale, kv_dtype).view(torch.uint8))
    assert k_store[loc].view(kv_dtype).float().isfinite().all()
    k_cache = k_store.view(kv_dtype).to(torch.float64) * k_scale
    v_cache = v_store.view(kv_dtype).to(torch.float64) * v_scale
    expected = _reference(fixture, q.view(-1, attn.tp_q_head_num, attn.head_dim), k_cache, v_cache)
    torch.testing.assert_close(out.to(torch.float64).view_as(expected), expected, atol=1e-5, rtol=0)


def _reference(fixture, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch, attn = fixture.forward_batch, fixture.actual_module.attn
    table = fixture.runner.req_to_token_pool.req_to_token
    new = [1] * batch.batch_size if batch.forward_mode.is_decode() else list(batch.extend_seq_lens_cpu)
    outs, start = [], 0
    for i, (seq_len, n) in enumerate(zip(batch.seq_lens_cpu.tolist(), new, strict=True)):
        slots = table[int(batch.req_pool_indices[i]), :seq_len].to(torch.int64)
        outs.append(
            reference_request_attention(
                q[start : start + n], k_cache[slots], v_cache[slots], prefix_len=seq_len - n, scaling=attn.scaling
            )
        )
        start += n
    return torch.cat(outs)


# -- refusals by name -----------------------------------------------------------------------------------------

_PLUGIN = '''\
"""torch_native's arithmetic, declaring token slots and float caches only."""
from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class SlotsOnly(TorchNativeAttnBackend):
    capabilities = BackendCapabilities(page_sizes=(1,), flat_heads=True)
'''


@pytest.fixture(scope="module")
def slots_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[type]:
    """The plugin's factory, imported from a real installed distribution as the bridge loads it."""
    site = tmp_path_factory.mktemp("slots-only")
    make_dist(
        site, "slots-only", "1.0", {GROUP: {"slots_only": "slots_only:SlotsOnly"}}, modules={"slots_only": _PLUGIN}
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        yield importlib.import_module("slots_only").SlotsOnly


def _adapter(fixture, factory: type) -> SGLangAdapterBackend:  # type: ignore[no-untyped-def]
    """The adapter as the bridge builds it for the plugin (its declared capabilities), over the fixture's runner."""
    return SGLangAdapterBackend(
        fixture.runner,
        engine_name="slots_only",
        attnhost_name="slots_only",
        origin="plugin 'slots_only' (distribution slots-only 1.0)",
        factory=factory,
        capabilities=capabilities_of(factory),
    )


WHERE = (
    r"attnhost backend 'slots_only' \(plugin 'slots_only' \(distribution slots-only 1\.0\)\), "
    r"SGLang --attention-backend 'slots_only'"
)


def test_a_backend_without_the_page_size_is_refused_by_name(slots_only: type) -> None:
    fixture = _fixture(_case(16, ForwardMode.DECODE, "torch_native"))
    with pytest.raises(UnsupportedFeatureError) as refused:
        _adapter(fixture, slots_only)
    message = str(refused.value)
    expected = (
        rf"{WHERE} does not support KV-cache page size 16 \(it reads page sizes 1; BackendCapabilities.page_sizes\); "
        r"run SGLang with a --kv-cache-dtype and --page-size it declares \(this cache: float32 in pages of 16\), "
        r"or choose with --attention-backend a backend that declares them \(e\.g\. attnhost_torch_native\)$"
    )
    assert re.match(expected, message), message
    one_page = _fixture(_case(1, ForwardMode.DECODE, "torch_native"))
    assert _adapter(one_page, slots_only)._kv.page_size == 1  # the page size it declares is built


@pytest.mark.parametrize("kv_dtype", FP8)
def test_a_backend_without_fp8_is_refused_by_name(slots_only: type, kv_dtype: torch.dtype) -> None:
    name = str(kv_dtype).removeprefix("torch.")
    fixture = fp8_fixture(_case(1, ForwardMode.DECODE, "torch_native"), kv_dtype, max_context_len=128)
    with pytest.raises(
        UnsupportedFeatureError,
        match=rf"{WHERE} does not support an FP8 KV cache of dtype {name} \(it reads KV caches of float32, "
        r"bfloat16, float16; BackendCapabilities.kv_cache_dtypes\); run SGLang with a --kv-cache-dtype and "
        rf"--page-size it declares \(this cache: {name} in pages of 1\)",
    ):
        _adapter(fixture, slots_only)


def test_torch_native_declares_fp8_and_every_page_size() -> None:
    from attnhost_builtin.torch_native import TorchNativeAttnBackend

    capabilities = capabilities_of(TorchNativeAttnBackend)
    assert capabilities.page_sizes is None
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(capabilities.kv_cache_dtypes or ())
