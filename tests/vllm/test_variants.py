"""Sliding windows, logit soft-caps, sinks and non-causal batches through vLLM's attention interface.

What vLLM asks and how the adapter answers, from what each backend declares:
vLLM's selector hooks (``supports_sink``, ``supports_sliding_window``,
``supports_non_causal``, ``validate_configuration``), the impl's constructor
(vLLM's ``sliding_window = W`` becomes attnhost's ``sliding_window_size = W -
1``; the soft-cap; the sinks, kept as the model's own tensor and passed per
call) and the builder (``SlidingWindowSpec`` groups, non-causal batches).
Then numbers: the engine kit's variant cases (:data:`attnhost_vllm_cpu.forward.VARIANTS`,
windows crossing the prefix with vLLM's null block before them) for the
project's backends that declare the variants, vLLM's own ``Attention`` layer
with a window, a soft-cap and sinks, and backends wrong by one window key, a
missing cap, missing sinks or a causal mask on a non-causal batch, each caught.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from attnhost_vllm_cpu.forward import VARIANT_BLOCK_SIZES, VARIANTS, WINDOW, ForwardCase, check
from attnhost_vllm_cpu.kit import Variant, make_case
from selector import selector_reasons
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, RSWASpec, SlidingWindowSpec

from attnhost.backend import AttentionLayer, BackendCapabilities
from attnhost.engines.vllm.adapter import UnsupportedFeatureError, dense_backend_class
from attnhost.engines.vllm.variants import WINDOWED_NON_CAUSAL
from attnhost.forward_batch import ForwardBatch
from attnhost_builtin.torch_native import TorchNativeAttnBackend

VARIANT_BACKENDS = ["TORCH_NATIVE", "BATCHED_MATMUL"]
"""The project's vLLM names whose backends declare every variant."""
PLAIN = "TINY"
"""A project backend that declares none of them."""


def backend(name: str) -> Any:
    return AttentionBackendEnum[name].get_class()


def impl(name: str, **overrides: Any) -> Any:
    args: dict[str, Any] = dict(
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
    return backend(name).get_impl_cls()(**args)


def reasons(name: str, **overrides: object) -> list[str]:
    return selector_reasons(backend(name), **overrides)


# -- vLLM's selector -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VARIANT_BACKENDS)
def test_the_selector_accepts_what_the_backend_declares(name: str) -> None:
    cls = backend(name)
    assert cls.supports_sink() and cls.supports_sliding_window() and cls.supports_non_causal()
    assert not cls.supports_attn_type(AttentionType.ENCODER_ONLY)  # no KV cache there: attnhost reads the cache
    served: list[dict[str, bool]] = [
        {"has_sink": True},
        {"has_sliding_window": True},
        {"use_non_causal": True},
        {"has_sink": True, "has_sliding_window": True},
        {"has_sink": True, "use_non_causal": True},
    ]
    for flags in served:
        assert reasons(name, **flags) == [], flags


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"has_sink": True}, "attention sinks not supported: it does not declare BackendCapabilities.sinks"),
        (
            {"has_sliding_window": True},
            "sliding window not supported: it does not declare BackendCapabilities.sliding_window",
        ),
        (
            {"use_non_causal": True},
            "non-causal attention not supported: it does not declare BackendCapabilities.non_causal",
        ),
    ],
)
def test_the_selector_refuses_what_the_backend_does_not_declare(flags: dict[str, bool], says: str) -> None:
    cls = backend(PLAIN)
    assert not (cls.supports_sink() or cls.supports_sliding_window() or cls.supports_non_causal())
    (reason,) = reasons(PLAIN, **flags)
    assert reason == f"{cls.identity.where}: {says}", reason
    assert "attnhost backend 'tiny'" in reason and "vLLM --attention-backend TINY" in reason


def test_the_selector_refuses_a_window_on_non_causal_batches() -> None:
    """vLLM's kernels make such a window symmetric; attnhost's contract limits the left side only."""
    (reason,) = reasons("TORCH_NATIVE", has_sliding_window=True, use_non_causal=True)
    assert "attnhost backend 'torch_native'" in reason and reason.endswith(WINDOWED_NON_CAUSAL), reason


def test_mla_names_refuse_the_variants_their_dense_twins_serve() -> None:
    cls = backend("TORCH_NATIVE_MLA")
    assert not (cls.supports_sink() or cls.supports_sliding_window() or cls.supports_non_causal())
    config = {"use_mla": True, "head_size": 576}
    (reason,) = reasons("TORCH_NATIVE_MLA", has_sink=True, **config)
    assert reason.endswith("attention sinks not supported: attnhost's MLA forms are plain causal attention"), reason


# -- the impl: vLLM's arguments as attnhost's layer facts ------------------------------------------------------------


def test_the_impl_carries_vllms_variants_in_attnhosts_terms() -> None:
    sinks = torch.nn.Parameter(torch.randn(4), requires_grad=False)  # as gpt-oss builds them
    layer = impl("TORCH_NATIVE", sliding_window=4096, logits_soft_cap=50.0, sinks=sinks)
    facts: AttentionLayer = layer.layer
    assert (facts.sliding_window_size, facts.logit_cap, facts.has_sinks, facts.is_causal) == (4095, 50.0, True, True)
    assert layer.sinks is sinks  # the model's parameter itself: weight loading writes into what the backend reads
    assert layer.variants.bidirectional is None  # a window on a non-causal batch is refused, not reinterpreted
    plain = impl("TORCH_NATIVE", logits_soft_cap=0.0)
    assert plain.layer.variant_features == () and plain.sinks is None
    assert plain.variants.bidirectional == dataclasses.replace(plain.layer, is_causal=False)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            {"sliding_window": 8},
            "sliding-window attention (sliding_window_size=7; it does not declare "
            "sliding_window), asked by vLLM as sliding_window=8",
        ),
        (
            {"logits_soft_cap": 30.0},
            "logit soft-capping (logit_cap=30; it does not declare logit_cap), asked by vLLM as logits_soft_cap=30.0",
        ),
        (
            {"sinks": torch.zeros(4)},
            "attention sinks (has_sinks=True; it does not declare sinks), asked by vLLM as sinks",
        ),
    ],
)
def test_the_impl_refuses_a_variant_the_backend_does_not_declare(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        impl(PLAIN, **overrides)
    message = str(info.value)
    assert message.startswith("attnhost backend 'tiny'") and "vLLM --attention-backend TINY" in message, message
    assert f"does not support {says}; choose another --attention-backend" in message, message


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"sliding_window": 0}, "vLLM sliding_window=0"),
        ({"logits_soft_cap": -1.0}, "vLLM logits_soft_cap=-1.0"),
        ({"logits_soft_cap": float("inf")}, "vLLM logits_soft_cap=inf"),
        ({"sinks": torch.zeros(2)}, "attention sinks of shape (2,)"),
        ({"sinks": torch.zeros(4, 1)}, "attention sinks of shape (4, 1)"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, "attention sinks of dtype torch.int64"),
        ({"attn_type": AttentionType.ENCODER_ONLY}, "encoder_only attention"),
        ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
    ],
)
def test_the_impl_refuses_what_no_backend_serves(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        impl("TORCH_NATIVE", **overrides)
    assert "attnhost backend 'torch_native'" in str(info.value) and says in str(info.value), str(info.value)


# -- the builder: vLLM's KV-cache groups and batches -----------------------------------------------------------------


def window_spec(**overrides: Any) -> SlidingWindowSpec:
    args: dict[str, Any] = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    args.update(overrides)
    return SlidingWindowSpec(**args)


def full_spec(**overrides: Any) -> FullAttentionSpec:
    args: dict[str, Any] = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    args.update(overrides)
    return FullAttentionSpec(**args)


def builder(name: str, spec: Any) -> Any:
    return backend(name).get_builder_cls()(spec, ["layer.0"], VllmConfig(), "cpu")


def test_the_builder_serves_windowed_and_non_causal_groups_where_declared() -> None:
    for spec in (window_spec(), full_spec(sliding_window=64), full_spec(non_causal=True)):
        builder("TORCH_NATIVE", spec)


@pytest.mark.parametrize(
    ("name", "spec", "says"),
    [
        (PLAIN, window_spec(), "sliding-window attention (vLLM sliding_window=64; it does not declare sliding_window)"),
        (PLAIN, full_spec(sliding_window=64), "sliding-window attention (vLLM sliding_window=64"),
        (PLAIN, full_spec(non_causal=True), "non-causal (bidirectional) attention (it does not declare non_causal)"),
        ("TORCH_NATIVE", full_spec(attention_chunk_size=64), "chunked local attention"),
        (
            "TORCH_NATIVE",
            RSWASpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, rswa_window=64),
            "reference sliding-window attention (R-SWA)",
        ),
    ],
)
def test_the_builder_refuses_groups_it_cannot_serve(name: str, spec: Any, says: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        builder(name, spec)
    assert f"vLLM --attention-backend {name}" in str(info.value) and says in str(info.value), str(info.value)


def test_non_causal_batches_are_refused_where_they_would_mean_something_else() -> None:
    case = make_case([(16, 4), (0, 6)], block_size=16, num_heads=4, num_kv_heads=2, variant=Variant(causal=False))
    for name, spec, says in (
        (PLAIN, case.spec, "non-causal (bidirectional) attention"),
        ("TORCH_NATIVE", window_spec(), WINDOWED_NON_CAUSAL),
    ):
        with pytest.raises(UnsupportedFeatureError) as info:
            builder(name, spec).build(0, case.metadata)
        assert f"vLLM --attention-backend {name}" in str(info.value) and says in str(info.value), str(info.value)
    per_request = case.metadata.replace(causal=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(UnsupportedFeatureError, match="per-request causality"):
        builder("TORCH_NATIVE", case.spec).build(0, per_request)


def test_a_windowed_layer_in_a_full_group_refuses_a_non_causal_batch() -> None:
    """With vLLM's hybrid allocator off, a windowed layer shares a full-attention group: the selector refuses the
    pair first; should a non-causal batch still reach the layer, it is refused, never computed with no window."""
    case = make_case([(16, 4), (0, 6)], block_size=16, num_heads=4, num_kv_heads=2, variant=Variant(causal=False))
    metadata = builder("TORCH_NATIVE", case.spec).build(0, case.metadata)
    q, k, v = case.layer_inputs(0, torch.float32)
    windowed = impl("TORCH_NATIVE", sliding_window=8)
    with pytest.raises(UnsupportedFeatureError) as info:
        windowed.forward(None, q, k, v, case.caches[0], metadata, output=torch.empty(q.shape[0], 4, 32))
    assert "attnhost backend 'torch_native'" in str(info.value) and WINDOWED_NON_CAUSAL in str(info.value)


# -- numbers ---------------------------------------------------------------------------------------------------------

NUMERIC_CASES = [
    pytest.param(
        name,
        ForwardCase("mixed", "gqa", block, torch.float32, variant=variant),
        id=f"{name.lower()}-{variant}-block{block}",
    )
    for name in VARIANT_BACKENDS
    for variant in VARIANTS
    for block in VARIANT_BLOCK_SIZES
]


@pytest.mark.parametrize(("name", "fcase"), NUMERIC_CASES)
def test_the_kits_variant_cases(name: str, fcase: ForwardCase) -> None:
    check(backend(name), fcase, f"{name}, {fcase.describe()}")


def test_vllms_attention_layer_with_a_window_a_soft_cap_and_sinks() -> None:
    """vLLM's own ``Attention`` layer, built as Gemma 2 / gpt-oss build theirs (``per_layer_sliding_window``,
    ``logits_soft_cap``, ``sinks=`` the model's parameter), on the group spec it asks for, through vLLM's custom op."""
    cls = backend("TORCH_NATIVE")
    heads, kv_heads, dim = 8, 2, 32
    variant = Variant(sliding_window=WINDOW, logits_soft_cap=1.5, sinks=True)
    case = make_case(
        [(16, 4), (WINDOW, 1), (33, 2), (0, 10)], block_size=4, num_heads=heads, num_kv_heads=kv_heads, variant=variant
    )
    assert case.sinks is not None
    config = VllmConfig()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(case.caches))]
    with set_current_vllm_config(config):
        layers = [
            Attention(
                heads,
                dim,
                dim**-0.5,
                num_kv_heads=kv_heads,
                prefix=n,
                attn_backend=cls,
                per_layer_sliding_window=WINDOW,
                logits_soft_cap=1.5,
                sinks=torch.nn.Parameter(torch.full((heads,), float("-inf")), requires_grad=False),
            )
            for n in names
        ]
    for layer, cache, sinks in zip(layers, case.caches, case.sinks, strict=True):
        assert layer.impl.layer.sliding_window_size == WINDOW - 1 and layer.has_sink
        layer.impl.sinks.data.copy_(sinks)  # weight loading writes into the parameter the impl holds
        layer.kv_cache = cache
        spec = layer.get_kv_cache_spec(config)
        assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == WINDOW
    group_builder = cls.get_builder_cls()(case.spec, names, config, "cpu")
    metadata = group_builder.build(0, case.metadata)
    n = case.num_tokens
    with set_forward_context(
        dict.fromkeys(names, metadata), config, slot_mapping=dict.fromkeys(names, case.metadata.slot_mapping)
    ):
        for i, layer in enumerate(layers):
            q, k, v = case.layer_inputs(i, torch.float32)
            out = layer(q.flatten(1), k.flatten(1), v.flatten(1))
            torch.testing.assert_close(out[:n].view(n, heads, dim).double(), case.reference(i), atol=2e-5, rtol=2e-5)


# -- the kit catches a backend wrong in one variant ------------------------------------------------------------------


def _shifted(layer: AttentionLayer, by: int) -> AttentionLayer:
    return dataclasses.replace(layer, sliding_window_size=layer.sliding_window_size + by)


class _Wrong(TorchNativeAttnBackend):
    """torch_native with one variant fact changed before every call (``wrong`` maps the layer and the sinks)."""

    def wrong(self, layer: AttentionLayer, sinks: torch.Tensor | None) -> tuple[AttentionLayer, torch.Tensor | None]:
        raise NotImplementedError

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        layer, sinks = self.wrong(layer, sinks)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        layer, sinks = self.wrong(layer, sinks)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)


class WindowOneTooWide(_Wrong):
    """Keeps ``W + 1`` keys (SGLang's triton extend kernel did)."""

    def wrong(self, layer: AttentionLayer, sinks: torch.Tensor | None) -> tuple[AttentionLayer, torch.Tensor | None]:
        return (_shifted(layer, 1) if layer.sliding_window_size >= 0 else layer), sinks


class WindowOneTooNarrow(_Wrong):
    """Keeps ``W - 1`` keys (``sliding_window`` taken for the left extent, then one subtracted again)."""

    def wrong(self, layer: AttentionLayer, sinks: torch.Tensor | None) -> tuple[AttentionLayer, torch.Tensor | None]:
        return (_shifted(layer, -1) if layer.sliding_window_size > 0 else layer), sinks


class NoSoftCap(_Wrong):
    def wrong(self, layer: AttentionLayer, sinks: torch.Tensor | None) -> tuple[AttentionLayer, torch.Tensor | None]:
        return dataclasses.replace(layer, logit_cap=0.0), sinks


class NoSinks(_Wrong):
    def wrong(self, layer: AttentionLayer, sinks: torch.Tensor | None) -> tuple[AttentionLayer, torch.Tensor | None]:
        return dataclasses.replace(layer, has_sinks=False), None


class CausalAnyway(_Wrong):
    def wrong(self, layer: AttentionLayer, sinks: torch.Tensor | None) -> tuple[AttentionLayer, torch.Tensor | None]:
        return dataclasses.replace(layer, is_causal=True), sinks


def wrong_class(factory: type) -> Any:
    identity = dataclasses.replace(
        backend("TORCH_NATIVE").identity,
        factory=factory,
        engine_name=factory.__name__.upper(),
        capabilities=BackendCapabilities(sliding_window=True, logit_cap=True, sinks=True, non_causal=True),
    )
    return dense_backend_class(identity)


@pytest.mark.parametrize(
    ("factory", "variant", "block_size"),
    [
        (WindowOneTooWide, "window-decode-edge", 16),  # the key before the window is still in a live block
        (WindowOneTooWide, "window-decode-edge", 1),  # the key before the window is in vLLM's null block
        (WindowOneTooNarrow, "window-decode-edge", 16),
        (WindowOneTooWide, "window-extend", 16),
        (NoSoftCap, "softcap", 16),
        (NoSinks, "sinks", 16),
        (CausalAnyway, "non-causal", 16),
    ],
)
def test_a_backend_wrong_in_one_variant_fails_the_kit(factory: type, variant: str, block_size: int) -> None:
    cls = wrong_class(factory)
    check(cls, ForwardCase("mixed", "gqa", block_size, torch.float32, variant="window-longer-than-sequences"), "ok")
    fcase = ForwardCase("mixed", "gqa", block_size, torch.float32, variant=variant)
    with pytest.raises(AssertionError, match=r"^wrong: max abs error \d\.\de[+-]\d\d exceeds 2e-05 .*\(layer \d, "):
        check(cls, fcase, "wrong")
