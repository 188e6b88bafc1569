"""attnhost's MLA backends through vLLM's MLA interface, on vLLM's own MLA cache and metadata.

Two levels, both against float64 references. The layer: vLLM's own ``MLAAttention`` (as DeepSeek builds it, its
``kv_b_proj`` a real ``ColumnParallelLinear``), which writes the latent through ``do_kv_cache_update``, splits
the batch, absorbs ``W_UK`` and up-projects with ``W_UV`` around ``forward_mqa``, and calls ``forward_mha`` for
prefills: the engine kit's MLA case (:mod:`attnhost_vllm_cpu.mla`), checked against decompressed attention, here
for two latent shapes. The impl: ``forward_mqa`` against :func:`~attnhost.testing.mla_reference.reference_mla_absorbed`
and ``forward_mha`` against :func:`~attnhost.testing.mla_reference.reference_mla_mha`, on an attnhost batch the
test lays out itself (its own slots, not vLLM's block arithmetic). Then registration, the views, the refusals.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from attnhost_vllm_cpu.mla import (
    MLA_BATCHES,
    MLA_SHAPE,
    MLACase,
    make_mla_case,
    mla_check,
    mla_forward,
    mla_problem,
    one_rank_group,
)
from selector import selector_reasons
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, KVQuantMode, MLAAttentionSpec

from attnhost.backend import AttentionLayer
from attnhost.engines.vllm import bridge
from attnhost.engines.vllm.adapter import UnsupportedFeatureError
from attnhost.engines.vllm.bridge import ClassPath
from attnhost.engines.vllm.mla_adapter import MLA_KV_LAYOUTS, mla_backend_class
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.mla import MLAConfig, MLAForm
from attnhost.mla_pool import MLAKVPool
from attnhost.testing.mla_reference import reference_mla_absorbed, reference_mla_mha
from attnhost_builtin.torch_native import TorchNativeAttnBackend

NAME = "TORCH_NATIVE_MLA"
SHAPES = {
    "latent32": MLA_SHAPE,
    "latent64": MLAConfig(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32),
}
SPLITS = {"prefill": (0, 3), "decode": (4, 0), "mixed": (2, 2), "mixed_with_prefix": (4, 0), "prefix_cached": (3, 0)}
"""(num_decodes, num_prefills) vLLM's layer gets: requests served by forward_mqa, and by forward_mha."""
LAYER_NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module", autouse=True)
def tp_group() -> Iterator[None]:
    """vLLM's linear layers need a tensor-parallel group: one rank for this module, torn down after it."""
    with one_rank_group():
        yield


def mla_class() -> Any:
    return AttentionBackendEnum[NAME].get_class()


def impl_for(case: MLACase, cls: Any = None, kv_b_proj: Any = None, **overrides: Any) -> Any:
    mla = case.mla
    args: dict[str, Any] = dict(
        num_heads=case.num_heads,
        head_size=mla.latent_dim,
        scale=case.scale,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        qk_head_dim=mla.qk_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_b_proj=kv_b_proj,
    )
    args.update(overrides)
    return (cls or mla_class()).get_impl_cls()(**args)


def attnhost_batch(case: MLACase, layer: int) -> tuple[ForwardBatch, MLAKVPool]:
    """The case's batch on attnhost's own latent pool, in float64, laid out by attnhost (not by vLLM's blocks)."""
    reqs = case.requests
    pool = MLAKVPool(
        1,
        sum(r.seq for r in reqs),
        case.mla,
        max_requests=len(reqs),
        max_context_len=max(r.seq for r in reqs),
        dtype=torch.float64,
    )
    specs = []
    for r in reqs:
        row = pool.alloc_request()
        pool.req_to_token[row, : r.prefix] = pool.alloc_slots(r.prefix)
        specs.append((row, r.prefix, r.query))
    mode = ForwardMode.DECODE if all(r.query == 1 for r in reqs) else ForwardMode.EXTEND
    batch = ForwardBatch.prepare(pool, mode, specs)
    for (row, _, _), r in zip(specs, reqs, strict=True):
        pool.set_kv(0, pool.req_to_token[row, : r.seq], r.latent[layer].unsqueeze(1))
    return batch, pool


def kv_b_proj_for(case: MLACase, layer: int, dtype: torch.dtype) -> ColumnParallelLinear:
    mla = case.mla
    with set_current_vllm_config(VllmConfig()):
        proj = ColumnParallelLinear(
            mla.kv_lora_rank, case.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False, params_dtype=dtype
        )
    with torch.no_grad():
        proj.weight.copy_(case.weights[layer].to(dtype))
    proj._cpu_skip_gemm_dispatch = True  # as MLAAttention marks its kv_b_proj
    proj.quant_method.process_weights_after_loading(proj)
    return proj


# -- registration ------------------------------------------------------------------------------------------------


def test_an_mla_capable_backend_is_registered_twice_as_vllm_names_its_pairs() -> None:
    member = AttentionBackendEnum[NAME]
    assert isinstance(member.value, ClassPath) and member.value == f"attnhost.engines.vllm.backends.{NAME}"
    assert pickle.loads(pickle.dumps(member)) is member
    cls, dense = member.get_class(), AttentionBackendEnum.TORCH_NATIVE.get_class()
    assert cls.is_mla() and not dense.is_mla()
    assert cls.get_name() == NAME and cls.identity.attnhost_name == dense.identity.attnhost_name == "torch_native"
    assert (cls.identity.sibling, dense.identity.sibling) == ("TORCH_NATIVE", NAME)
    assert bridge.mla_name("TORCH_NATIVE") == NAME and bridge.exported()[NAME].name == "torch_native"
    assert [str(d) for d in cls.supported_dtypes] == ["torch.float32", "torch.bfloat16", "torch.float16"]
    assert cls.get_supported_head_sizes() == [] and cls.supported_kv_cache_layouts() == MLA_KV_LAYOUTS
    assert cls.get_impl_cls().__qualname__ == f"{NAME}.Impl" and cls.get_builder_cls().__qualname__ == f"{NAME}.Builder"


@pytest.mark.parametrize("name", ["TINY", "CPU_PAGED"])
def test_backends_without_mla_get_no_mla_name(name: str) -> None:
    assert bridge.mla_name(name) is None and f"{name}_MLA" not in AttentionBackendEnum.__members__
    assert AttentionBackendEnum[name].get_class().identity.sibling is None


def test_the_example_that_declares_mla_gets_its_mla_twin() -> None:
    assert bridge.mla_name("BATCHED_MATMUL") == "BATCHED_MATMUL_MLA"
    assert AttentionBackendEnum["BATCHED_MATMUL"].get_class().identity.sibling == "BATCHED_MATMUL_MLA"


# -- vLLM's MLAAttention layer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("batch", list(MLA_BATCHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_vllms_mla_layer_matches_decompressed_attention(shape: str, batch: str, block_size: int) -> None:
    case = make_mla_case(MLA_BATCHES[batch], block_size=block_size, mla=SHAPES[shape])
    before = [cache.clone() for cache in case.caches]
    outputs, metadata = mla_forward(mla_class(), case, torch.float32, f"{shape} {batch}")
    assert (metadata.num_decodes, metadata.num_prefills) == SPLITS[batch]
    assert (metadata.absorbed is not None, metadata.mha is not None) == (SPLITS[batch][0] > 0, SPLITS[batch][1] > 0)
    found = mla_problem(case, outputs, before, 2e-5)
    assert found is None, found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vllms_mla_layer_in_half_precision(dtype: torch.dtype) -> None:
    mla_check(mla_class(), "mixed", 16, dtype, f"mixed batch, {dtype}")


@pytest.mark.parametrize("layout", [layout.name for layout in MLA_KV_LAYOUTS])
def test_every_layer_compact_layout_is_read_in_place(layout: str) -> None:
    case = make_mla_case(MLA_BATCHES["mixed"], block_size=16, layout=KVCacheLayout[layout])
    before = [cache.clone() for cache in case.caches]
    outputs, _ = mla_forward(mla_class(), case, torch.float32, layout)
    assert mla_problem(case, outputs, before, 2e-5) is None


def test_other_layouts_are_refused_naming_the_layout() -> None:
    """Layer-interleaved pages (BLNHC): a layer's latent rows have no token-major view, so no copy is made."""
    case = make_mla_case(MLA_BATCHES["decode"], block_size=16, layout=KVCacheLayout.BLNHC)
    with pytest.raises(AssertionError) as info:
        mla_forward(mla_class(), case, torch.float32, "BLNHC")
    cause = info.value.__cause__
    assert isinstance(cause, UnsupportedFeatureError), info.value
    assert "attnhost backend 'torch_native'" in str(cause) and "layout" in str(cause)
    assert "VLLM_KV_CACHE_LAYOUT=LBNHC" in str(cause)


# -- the impl, form by form ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_apart", [True, False], ids=["q_rope_apart", "joined"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("batch", ["decode", "prefix_cached", "mixed_with_prefix"])
def test_forward_mqa_matches_the_absorbed_reference(batch: str, block_size: int, rope_apart: bool) -> None:
    case = make_mla_case(MLA_BATCHES[batch], block_size=block_size, num_layers=1)
    cls = mla_class()
    metadata = cls.get_builder_cls()(case.spec, LAYER_NAMES[:1], VllmConfig(), "cpu").build(0, case.metadata)
    assert metadata.num_decode_tokens == case.num_tokens and metadata.mha is None
    impl = impl_for(case)
    cache = case.caches[0].squeeze(1)  # [blocks, block_size, width], as MLAAttention binds it
    _, kv_c, k_pe = case.layer_inputs(0, torch.float32)  # with vLLM's padded rows (slot -1) at the end
    impl.do_kv_cache_update(kv_c, k_pe, cache, case.metadata.slot_mapping, "auto", None)
    rank = case.mla.kv_lora_rank
    q = torch.randn(case.num_tokens, case.num_heads, case.mla.latent_dim, dtype=torch.float64)
    query = (q[..., :rank].float(), q[..., rank:].float()) if rope_apart else q.float()
    out, lse = impl.forward_mqa(query, cache, metadata, None)
    assert lse is None and out.shape == (case.num_tokens, case.num_heads, rank)
    batch_, pool = attnhost_batch(case, 0)
    layer = AttentionLayer.for_mla(case.mla, MLAForm.ABSORBED, 0, case.num_heads, case.scale)
    ref = reference_mla_absorbed(q, layer, batch_, pool.k_buffer(0))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_forward_mha_matches_the_mha_reference(block_size: int) -> None:
    case = make_mla_case(MLA_BATCHES["prefill"], block_size=block_size, num_layers=1)
    cls = mla_class()
    metadata = cls.get_builder_cls()(case.spec, LAYER_NAMES[:1], VllmConfig(), "cpu").build(0, case.metadata)
    assert metadata.num_decode_tokens == 0 and metadata.absorbed is None
    impl = impl_for(case, kv_b_proj=kv_b_proj_for(case, 0, torch.float32))
    n, heads, v_dim = case.num_tokens, case.num_heads, case.mla.v_head_dim
    q, kv_c, k_pe = (t[:n] for t in case.layer_inputs(0, torch.float32))
    output = torch.full((n, heads * v_dim), float("nan"))
    impl.forward_mha(q, kv_c, k_pe, case.caches[0].squeeze(1), metadata, None, output)
    keys, values = zip(*(case.decompressed(0, r) for r in case.requests), strict=True)
    batch, _ = attnhost_batch(case, 0)
    layer = AttentionLayer.for_mla(case.mla, MLAForm.MHA, 0, heads, case.scale)
    ref = reference_mla_mha(q.double(), torch.cat(keys), torch.cat(values), layer, batch)
    torch.testing.assert_close(output.view(n, heads, v_dim).double(), ref, atol=2e-5, rtol=2e-5)


def test_latent_views_are_vllms_memory_and_each_form_has_its_own_backend() -> None:
    case = make_mla_case(MLA_BATCHES["mixed"], block_size=16)
    builder = mla_class().get_builder_cls()(case.spec, LAYER_NAMES, VllmConfig(), "cpu")
    assert builder.attnhost_backend is not builder.mha_backend
    for backend in (builder.attnhost_backend, builder.mha_backend):
        assert backend.prefill_attention_backend_str == backend.decode_attention_backend_str == "torch_native"
    metadata = builder.build(0, case.metadata)
    assert metadata.absorbed.backend is builder.attnhost_backend and metadata.mha.backend is builder.mha_backend
    impl = impl_for(case)
    cache = case.caches[0].squeeze(1)
    rank = case.mla.kv_lora_rank
    q = torch.randn(metadata.num_decode_tokens, case.num_heads, case.mla.latent_dim)
    impl.forward_mqa((q[..., :rank], q[..., rank:]), cache, metadata, None)
    kv = metadata.absorbed.kv
    rows, values = kv.k_buffer(impl.absorbed_layer.layer_id), kv.v_buffer(impl.absorbed_layer.layer_id)
    assert rows.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert rows.shape == (cache.shape[0] * 16, 1, case.mla.latent_dim) and rows.data_ptr() == values.data_ptr()
    assert values.shape == (cache.shape[0] * 16, 1, rank) and not values.is_contiguous()
    r = case.requests[2]  # req_to_token is block_table at token level
    assert kv.req_to_token[2, : r.seq].tolist() == [r.blocks[p // 16] * 16 + p % 16 for p in range(r.seq)]


@pytest.mark.parametrize("block_size", [1, 16])
def test_the_latent_cache_reports_vllms_block_size_as_its_page_size(block_size: int) -> None:
    """A paged MLA backend reads ``ForwardBatch.page_table``: its pages must be vLLM's blocks, as the dense view's."""
    case = make_mla_case(MLA_BATCHES["mixed_with_prefix"], block_size=block_size, num_layers=1)
    metadata = mla_class().get_builder_cls()(case.spec, LAYER_NAMES[:1], VllmConfig(), "cpu").build(0, case.metadata)
    form = metadata.absorbed
    assert form.kv.page_size == block_size
    pages = form.batch.page_table
    for row, r in enumerate(case.requests):
        used = -(-r.seq // block_size)
        assert pages[row, :used].tolist() == list(r.blocks[:used]), f"request {row}'s pages are not its blocks"


class _Raising(TorchNativeAttnBackend):
    """A plugin whose MLA kernels break on this machine."""

    def forward_mla_mqa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise ValueError("illegal instruction")

    def forward_mla_mha(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise ValueError("illegal instruction")


@pytest.mark.parametrize("form", ["forward_mla_mqa", "forward_mla_mha"])
def test_an_mla_kernel_that_raises_is_named_with_its_plugin_form_and_layer(form: str) -> None:
    from attnhost import BackendFailedError

    identity = dataclasses.replace(mla_class().identity, factory=_Raising)
    cls = mla_backend_class(identity)
    batch = "decode" if form == "forward_mla_mqa" else "prefill"
    case = make_mla_case(MLA_BATCHES[batch], block_size=16, num_layers=1)
    metadata = cls.get_builder_cls()(case.spec, LAYER_NAMES[:1], VllmConfig(), "cpu").build(0, case.metadata)
    impl = impl_for(case, cls=cls, kv_b_proj=kv_b_proj_for(case, 0, torch.float32))
    cache = case.caches[0].squeeze(1)
    with pytest.raises(BackendFailedError) as caught:
        if form == "forward_mla_mqa":
            impl.forward_mqa(torch.randn(case.num_tokens, case.num_heads, case.mla.latent_dim), cache, metadata, None)
        else:
            q, kv_c, k_pe = (t[: case.num_tokens] for t in case.layer_inputs(0, torch.float32))
            output = torch.empty(case.num_tokens, case.num_heads * case.mla.v_head_dim)
            impl.forward_mha(q, kv_c, k_pe, cache, metadata, None, output)
    assert isinstance(caught.value.__cause__, ValueError)
    mode = "DECODE" if batch == "decode" else "(EXTEND|MIXED)"
    pattern = (
        rf"^attnhost backend 'torch_native' \(plugin 'builtin' .*failed in {form} \({mode} batch, layer "
        rf"{impl.absorbed_layer.layer_id}\): ValueError: illegal instruction.*report this to the maintainers"
    )
    assert re.search(pattern, str(caught.value)), str(caught.value)


# -- a wrong form is caught, and only where it runs -------------------------------------------------------------------


class WrongAbsorbed(TorchNativeAttnBackend):
    """The absorbed form off by half."""

    def forward_mla_mqa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward_mla_mqa(*args, **kwargs) * 1.5


class WrongMHA(TorchNativeAttnBackend):
    """The MHA form off by half."""

    def forward_mla_mha(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward_mla_mha(*args, **kwargs) * 1.5


@pytest.mark.parametrize(
    ("factory", "fails", "passes"), [(WrongAbsorbed, "decode", "prefill"), (WrongMHA, "prefill", "decode")]
)
def test_each_form_is_checked_where_vllm_calls_it(factory: type, fails: str, passes: str) -> None:
    identity = dataclasses.replace(mla_class().identity, factory=factory, engine_name=f"{factory.__name__.upper()}")
    cls = mla_backend_class(identity)
    mla_check(cls, passes, 16, torch.float32, passes)
    with pytest.raises(AssertionError, match=rf"^{fails}: max abs error \d\.\de[+-]\d\d exceeds 2e-05 .*\(layer 0, "):
        mla_check(cls, fails, 16, torch.float32, fails)


# -- refusals ------------------------------------------------------------------------------------------------------


def reasons(name: str, **overrides: object) -> list[str]:
    """vLLM's selector on backend ``name`` for an MLA layer (head size 576: latent plus rope)."""
    return selector_reasons(AttentionBackendEnum[name].get_class(), **{"head_size": 576, "use_mla": True, **overrides})


def test_selection_accepts_mla_and_points_each_kind_at_its_name() -> None:
    assert reasons(NAME) == [] and reasons(NAME, head_size=48, dtype=torch.float32, block_size=1) == []
    (dense,) = reasons(NAME, use_mla=False, head_size=64)
    assert "attnhost backend 'torch_native'" in dense, dense
    assert dense.endswith("select its dense backend, --attention-backend torch_native"), dense
    (mla,) = reasons("TORCH_NATIVE")
    assert mla.endswith("MLA not supported: select its MLA backend, --attention-backend torch_native_mla"), mla
    (tiny,) = reasons("TINY")
    assert "'tiny'" in tiny and tiny.endswith("MLA not supported: it does not declare BackendCapabilities.mla"), tiny
    assert any("sparse" in reason for reason in reasons(NAME, use_sparse=True))
    assert any("kv_cache_dtype" in reason for reason in reasons(NAME, kv_cache_dtype="fp8"))


def mla_spec(**overrides: Any) -> MLAAttentionSpec:
    args: dict[str, Any] = dict(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.float32)
    args.update(overrides)
    return MLAAttentionSpec(**args)


@pytest.mark.parametrize(
    ("name", "spec", "says"),
    [
        (
            "TORCH_NATIVE",
            mla_spec(),
            "MLA (multi-head latent attention) under its dense name; select its MLA backend, "
            "--attention-backend torch_native_mla",
        ),
        ("TINY", mla_spec(), "MLA (multi-head latent attention): it does not declare BackendCapabilities.mla"),
        (
            NAME,
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32),
            "FullAttentionSpec KV-cache groups (dense attention) under its MLA name; select its dense backend",
        ),
        (NAME, mla_spec(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR, cache_dtype_str="fp8"), "a quantized MLA cache"),
        (NAME, mla_spec(topk_buffer_width=2048), "DeepSeek sparse attention"),
        (NAME, mla_spec(num_kv_heads=2), "2 KV heads"),
    ],
)
def test_builders_refuse_what_their_name_cannot_serve(name: str, spec: object, says: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        AttentionBackendEnum[name].get_class().get_builder_cls()(spec, ["layer.0"], VllmConfig(), "cpu")
    message = str(info.value)
    assert f"vLLM --attention-backend {name}" in message and says in message, message


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"indexer": object()}, "DeepSeek sparse attention"),
        ({"sliding_window": 128}, "sliding-window MLA"),
        ({"kv_cache_dtype": "fp8"}, "quantized MLA cache"),
        ({"logits_soft_cap": 30.0}, "logit soft-capping"),
        ({"attn_type": AttentionType.ENCODER_ONLY}, "encoder_only attention"),
        ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV-cache sharing"),
        ({"topk_indices_buffer": torch.zeros(1)}, "extra MLA arguments topk_indices_buffer"),
        ({"head_size": 40}, "1 KV heads of size 40"),
    ],
)
def test_the_impl_refuses_what_the_contract_cannot_express(overrides: dict[str, Any], says: str) -> None:
    case = make_mla_case(MLA_BATCHES["decode"], block_size=16, num_layers=1)
    with pytest.raises(UnsupportedFeatureError) as info:
        impl_for(case, **overrides)
    assert "attnhost backend 'torch_native'" in str(info.value) and says in str(info.value), str(info.value)


def test_padding_between_real_tokens_is_refused() -> None:
    """vLLM pads slot_mapping with -1 after the last real token; a -1 between them (context parallelism) would
    lose a latent row, so it is refused rather than skipped."""
    case = make_mla_case(MLA_BATCHES["decode"], block_size=16, num_layers=1, padding=0)
    _, kv_c, k_pe = case.layer_inputs(0, torch.float32)
    slots = case.metadata.slot_mapping.clone()
    slots[1] = slots[3] = -1
    with pytest.raises(UnsupportedFeatureError, match=r"padding slots .* between real tokens"):
        impl_for(case).do_kv_cache_update(kv_c, k_pe, case.caches[0].squeeze(1), slots, "auto", None)


# -- naming ----------------------------------------------------------------------------------------------------------


def plan_with(vllm_names: set[str], override: bool = False) -> tuple[list[Any], list[str]]:
    """The MLA names for the real registry's exports, as if vLLM had ``vllm_names`` itself."""
    from attnhost.engines.export import plan_exports
    from attnhost.engines.vllm.mla_names import plan_mla_exports
    from attnhost.engines.vllm.names import vllm_name
    from attnhost.settings import VLLM_OVERRIDE_ENV

    plan = plan_exports("vLLM", lambda name: False, override_env=VLLM_OVERRIDE_ENV, to_engine_name=vllm_name)
    if override:
        plan = dataclasses.replace(plan, backends=tuple(dataclasses.replace(b, overrides=True) for b in plan.backends))
    return plan_mla_exports(plan, lambda b: b.name == "torch_native", lambda name: name in vllm_names, (), vllm_name)


def test_an_mla_name_vllm_has_keeps_vllms_backend_unless_overridden() -> None:
    (plain,), warnings = plan_with(set())
    assert (plain.engine_name, plain.backend.engine_name, plain.overrides, warnings) == (
        "TORCH_NATIVE_MLA",
        "TORCH_NATIVE",
        False,
        [],
    )
    (renamed,), (warning,) = plan_with({"TORCH_NATIVE_MLA"})
    assert renamed.engine_name == "ATTNHOST_TORCH_NATIVE_MLA" and not renamed.overrides
    assert "vLLM implements 'TORCH_NATIVE_MLA' itself and keeps it" in warning
    assert "ATTNHOST_VLLM_OVERRIDE=torch_native" in warning
    (taken,), (warning,) = plan_with({"TORCH_NATIVE_MLA"}, override=True)
    assert taken.engine_name == "TORCH_NATIVE_MLA" and taken.overrides and "replaces vLLM's own" in warning
    exports, warnings = plan_with({"TORCH_NATIVE_MLA", "ATTNHOST_TORCH_NATIVE_MLA"})
    assert exports == [] and "gets no MLA name in vLLM: vLLM already has 'ATTNHOST_TORCH_NATIVE_MLA'" in warnings[-1]
