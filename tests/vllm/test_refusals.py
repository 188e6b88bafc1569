"""What the attnhost contract cannot express is refused with one error naming the backend and the feature.

Three places, all vLLM's own: ``validate_configuration`` when vLLM selects
the backend for a layer, the impl's constructor (per layer: ALiBi,
encoder/cross attention, KV sharing, quantized caches other than FP8), and the builder (per KV-cache
group: MLA and cross-attention specs, quantized caches) — plus the layout
check on the first forward. The attention variants a backend may declare
(sliding windows, soft-caps, sinks, non-causal batches) are served or
refused by what it declares: ``test_variants.py``.
"""

from __future__ import annotations

import pytest
import torch
from attnhost_vllm_cpu.kit import BATCHES_DECODE, make_case
from selector import selector_reasons
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheLayout,
    MLAAttentionSpec,
)

from attnhost.engines.vllm.adapter import UnsupportedFeatureError

NAME = "TORCH_NATIVE"


def backend() -> type:
    return AttentionBackendEnum[NAME].get_class()


def impl(**overrides: object) -> object:
    args: dict[str, object] = dict(
        num_heads=4,
        head_size=32,
        scale=0.1,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
    )
    args.update(overrides)
    return backend().get_impl_cls()(**args)


def assert_names_backend_and(feature: str, exc: BaseException) -> None:
    message = str(exc)
    assert "attnhost backend 'torch_native'" in message and NAME in message, message
    assert feature in message, message


@pytest.mark.parametrize(
    ("overrides", "feature"),
    [
        ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
        ({"attn_type": AttentionType.ENCODER_DECODER}, "encoder_decoder attention"),
        ({"attn_type": AttentionType.ENCODER_ONLY}, "encoder_only attention"),
        ({"attn_type": AttentionType.ENCODER}, "encoder attention"),
        ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV-cache sharing"),
        ({"kv_cache_dtype": "int8_per_token_head"}, "quantized KV cache"),
        ({"kv_cache_dtype": "fp8_per_token_head"}, "quantized KV cache"),
    ],
)
def test_impl_refuses(overrides: dict[str, object], feature: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        impl(**overrides)
    assert_names_backend_and(feature, info.value)


def test_impl_accepts_a_plain_decoder_layer() -> None:
    assert impl().layer.num_kv_heads == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("spec", "feature"),
    [
        (
            MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
            "MLA",
        ),
        (CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32), "cross-attention"),
        (
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, head_size_v=64, dtype=torch.float32),
            "V head size",
        ),
    ],
)
def test_builder_refuses(spec: object, feature: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        backend().get_builder_cls()(spec, ["layer.0"], VllmConfig(), "cpu")
    assert_names_backend_and(feature, info.value)


def reasons(**overrides: object) -> list[str]:
    return selector_reasons(backend(), **overrides)


def test_selection_accepts_what_the_backend_declares() -> None:
    assert reasons() == []
    assert reasons(dtype=torch.float32) == []  # torch_native declares float32, bfloat16, float16
    assert reasons(block_size=1) == [] and reasons(block_size=48) == []


@pytest.mark.parametrize(
    ("overrides", "feature"),
    [
        ({"use_mla": True}, "MLA not supported"),
        ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype not supported"),
        ({"attn_type": AttentionType.ENCODER_DECODER}, "attention type"),
        ({"use_mm_prefix": True}, "multimodal"),
        ({"use_adaptive_verification": True}, "adaptive verification"),
    ],
)
def test_selection_refuses(overrides: dict[str, object], feature: str) -> None:
    found = reasons(**overrides)
    assert found and all("attnhost backend 'torch_native'" in reason for reason in found), found
    assert any(feature in reason for reason in found), found


def test_cuda_graphs_are_refused() -> None:
    """The builder reports NEVER, so vLLM keeps attention out of captured graphs; capture itself is refused."""
    cls = backend()
    builder_cls = cls.get_builder_cls()
    assert builder_cls.get_cudagraph_support(VllmConfig(), None) is AttentionCGSupport.NEVER
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    builder = builder_cls(spec, ["layer.0"], VllmConfig(), "cpu")
    case = make_case(BATCHES_DECODE, block_size=16, num_heads=4, num_kv_heads=2)
    with pytest.raises(UnsupportedFeatureError) as info:
        builder.build_for_cudagraph_capture(case.metadata)
    assert_names_backend_and("CUDA-graph capture", info.value)


def test_a_layout_without_a_zero_copy_view_is_refused() -> None:
    """With LBHNC (head-major pages) a flat token view would need a copy: refused, with the way out."""
    cls = backend()
    assert cls.supported_kv_cache_layouts() == (KVCacheLayout.LBNHC,)
    case = make_case(BATCHES_DECODE, block_size=16, num_heads=4, num_kv_heads=2, layout=KVCacheLayout.LBHNC)
    builder = cls.get_builder_cls()(case.spec, ["layer.0"], VllmConfig(), "cpu")
    metadata = builder.build(0, case.metadata)
    q, k, v = case.layer_inputs(0, torch.float32)
    with pytest.raises(UnsupportedFeatureError) as info:
        impl().forward(None, q, k, v, case.caches[0], metadata, output=torch.empty(q.shape[0], 4, 32))  # type: ignore[attr-defined]
    assert_names_backend_and("layout", info.value)
    assert "VLLM_KV_CACHE_LAYOUT=LBNHC" in str(info.value)


def test_cross_attention_batches_are_refused() -> None:
    cls = backend()
    case = make_case(BATCHES_DECODE, block_size=16, num_heads=4, num_kv_heads=2)
    builder = cls.get_builder_cls()(case.spec, ["layer.0"], VllmConfig(), "cpu")
    with pytest.raises(UnsupportedFeatureError) as info:
        builder.build(0, case.metadata.replace(encoder_seq_lens=torch.tensor([3, 3, 3, 3])))
    assert_names_backend_and("cross-attention", info.value)


def test_kv_update_bypass_is_refused() -> None:
    """A model that wrote K/V with a fused op and passes key=None: the adapter does not declare that bypass."""
    cls = backend()
    assert cls.supports_kv_cache_update_bypass is False and cls.forward_includes_kv_cache_update is True
    case = make_case(BATCHES_DECODE, block_size=16, num_heads=4, num_kv_heads=2)
    metadata = cls.get_builder_cls()(case.spec, ["layer.0"], VllmConfig(), "cpu").build(0, case.metadata)
    q, _, _ = case.layer_inputs(0, torch.float32)
    with pytest.raises(UnsupportedFeatureError) as info:
        impl().forward(None, q, None, None, case.caches[0], metadata, output=torch.empty(q.shape[0], 4, 32))  # type: ignore[attr-defined]
    assert_names_backend_and("KV-cache update bypass", info.value)
