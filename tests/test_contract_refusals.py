"""Values the contract cannot compute with are refused in one sentence naming them, where they enter: a scale or
a soft-cap that makes float32 overflow, FP8 write scales that would store garbage, sinks of the wrong kind, sinks
for a backend that declares none, a quantized latent cache, an FP8 format listed as a model dtype. Each was accepted
before and gave NaN, ±448, a raw ``AttributeError``/``TypeError``/``NotImplementedError`` or a self-contradicting
sentence."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from attnhost import AttentionLayer, BackendCapabilities, ForwardBatch, ForwardMode, KVPool  # noqa: E402
from attnhost.errors import UnsupportedFeatureError  # noqa: E402
from attnhost.mla import MLAConfig  # noqa: E402
from attnhost.mla_pool import MLAKVPool  # noqa: E402
from attnhost_builtin.torch_native import TorchNativeAttnBackend  # noqa: E402


@pytest.mark.parametrize("scaling", [math.nan, math.inf, -math.inf])
def test_a_scaling_that_is_not_a_finite_number_is_refused(scaling: float) -> None:
    with pytest.raises(ValueError, match=r"layer 0: scaling must be a finite number \(<= 0: 1/sqrt\(head_dim\)\)"):
        AttentionLayer(0, 4, 2, 16, scaling=scaling)


def test_a_soft_cap_or_fp8_scale_float32_cannot_carry_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logit_cap=1e\+300 is beyond what float16 holds \(65504\)"):
        AttentionLayer(0, 4, 2, 16, logit_cap=1e300)
    with pytest.raises(ValueError, match=r"k_scale=1e\+38 would read FP8's largest value \(57344\) back as more"):
        AttentionLayer(0, 4, 2, 16, k_scale=1e38)
    AttentionLayer(0, 4, 2, 16, logit_cap=50.0, k_scale=0.02)  # Gemma's cap, a usual scale


@pytest.mark.parametrize(
    "scale", [0.0, math.nan, -1.0, torch.tensor([0.5, 0.5])], ids=["zero", "nan", "neg", "per-head"]
)
def test_an_fp8_write_with_a_scale_that_is_not_one_positive_number_is_refused(scale: object) -> None:
    pool = KVPool(1, 8, 2, 16, max_requests=1, max_context_len=8, dtype="float8_e4m3fn")
    rows = torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match=r"KVPool.set_kv: k_scale must be one finite number > 0 for the layer"):
        pool.set_kv(0, torch.tensor([1, 2]), rows, rows, k_scale=scale)  # type: ignore[arg-type]
    assert not pool.k_buffer(0).view(torch.uint8).any(), "written before the refusal"


def _sink_layer_batch() -> tuple[AttentionLayer, ForwardBatch]:
    pool = KVPool(1, 16, 2, 16, max_requests=1, max_context_len=8)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(pool.alloc_request(), 0, 3)])
    return AttentionLayer(0, 4, 2, 16, has_sinks=True), batch


def test_sinks_given_as_a_list_get_a_sentence_not_an_attribute_error() -> None:
    layer, batch = _sink_layer_batch()
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    q, kv = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match=r"layer 0's sinks are a list, not a torch.Tensor; pass its \[4\] sink"):
        backend.forward(q, kv, kv, layer, batch, sinks=[0.1, 0.2, 0.3, 0.4])


class NoSinks(TorchNativeAttnBackend):
    """torch_native's kernels without the sinks declaration (as cpu_paged declares none)."""

    capabilities = BackendCapabilities()


def test_sinks_for_a_backend_that_declares_none_are_refused_by_name_not_a_type_error() -> None:
    layer, batch = _sink_layer_batch()
    backend = NoSinks()
    backend.init_forward_metadata(batch)
    q, kv = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with pytest.raises(UnsupportedFeatureError, match=r"'NoSinks' was passed sinks= but does not declare"):
        backend.forward(q, kv, kv, layer, batch, sinks=torch.zeros(4))


def test_a_quantized_latent_cache_is_refused_when_built() -> None:
    config = MLAConfig(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=4)
    with pytest.raises(ValueError, match=r"MLAKVPool: a latent cache of torch.float8_e4m3fn is not part of the"):
        MLAKVPool(1, 16, config, max_requests=1, max_context_len=8, dtype="float8_e4m3fn")


def test_an_fp8_format_listed_as_a_model_dtype_is_refused_with_where_it_belongs() -> None:
    with pytest.raises(ValueError, match=r"float8_e4m3fn is a cache format: list it in kv_cache_dtypes"):
        BackendCapabilities(dtypes=("bfloat16", "float8_e4m3fn"))


def test_a_pool_lays_its_cache_out_as_engines_do_and_refuses_other_table_dtypes() -> None:
    """SGLang's int32 table and a cache allocated in one piece (strided K/V views) are layouts the kit runs."""
    pool = KVPool(2, 16, 2, 8, max_requests=2, max_context_len=8, table_dtype=torch.int32, fused_kv=True)
    assert pool.req_to_token.dtype == torch.int32
    assert not pool.k_buffer(1).is_contiguous() and pool.k_buffer(1).stride(0) == 2 * 2 * 8
    loc = torch.tensor([3, 9])
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.k_buffer(1)[loc], k) and torch.equal(pool.v_buffer(1)[loc], v)
    assert not pool.k_buffer(0).any() and not pool.v_buffer(1)[[0, 1, 2]].any()
    with pytest.raises(ValueError, match=r"KVPool: table_dtype must be torch.int32 or torch.int64, got torch.int16"):
        KVPool(1, 16, 2, 8, max_requests=2, max_context_len=8, table_dtype=torch.int16)
    from attnhost import ModelRunner, ServerArgs

    mla = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    with pytest.raises(ValueError, match=r"fused_kv lays out separate K and V buffers; an MLA cache has one latent"):
        ModelRunner(ServerArgs(attention_backend="torch_native"), mla=mla, fused_kv=True)
