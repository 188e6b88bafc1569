"""The adapter's edges: what it refuses (never a wrong number), idle batches, stamps, isolation.

Fixtures are SGLang's own test-kit fixtures (real pools, real
``RadixAttention``), built by name through SGLang's ``ATTENTION_BACKENDS``
after SGLang's own ``load_plugins()``.
"""

from __future__ import annotations

import dataclasses
import unittest
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_tiny import TinyAttnBackend  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as SGLangAttentionBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    build_dense_attention_fixture,
    make_dense_cases,
)

from attnhost import BackendCapabilities  # noqa: E402
from attnhost.engines.sglang.adapter import SGLangAdapterBackend, UnsupportedFeatureError  # noqa: E402
from attnhost_builtin.torch_native import TorchNativeAttnBackend  # noqa: E402


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _fixture(backend: str = "tiny", index: int = 0, **changes: object):  # type: ignore[no-untyped-def]
    case = dataclasses.replace(make_dense_cases(backend)[index], **changes)
    with torch.no_grad():
        return build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)


def _qkv(fixture):  # type: ignore[no-untyped-def]
    case = fixture.case
    tokens = case.num_input_tokens
    return (
        torch.randn(tokens, case.num_heads * 16),
        torch.randn(tokens, case.num_kv_heads, 16),
        torch.randn(tokens, case.num_kv_heads, 16),
    )


def test_a_sliding_window_model_is_refused_at_construction() -> None:
    case = dataclasses.replace(make_dense_cases("tiny")[0], sliding_window_size=4)
    with pytest.raises(UnsupportedFeatureError, match=r"attnhost backend 'tiny' .* does not support sliding-window"):
        build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize(
    ("attribute", "value", "feature"),
    [
        ("logit_cap", 30.0, "logit soft-capping"),
        ("sliding_window_size", 8, "sliding-window attention"),
        ("is_cross_attention", True, "cross-attention"),
        ("v_head_dim", 8, "a V head dim"),
    ],
)
def test_a_layer_the_contract_cannot_express_is_refused_on_its_first_forward(
    attribute: str, value: object, feature: str
) -> None:
    fixture = _fixture()
    layer = fixture.actual_module.attn
    setattr(layer, attribute, value)
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    with pytest.raises(UnsupportedFeatureError, match=f"'tiny'.*does not support {feature}"):
        fixture.backend.forward(q, k, v, layer, fixture.forward_batch)


def test_extra_attention_arguments_are_refused_not_ignored() -> None:
    fixture = _fixture()
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    with pytest.raises(UnsupportedFeatureError, match=r"'tiny'.*does not support attention sinks"):
        fixture.backend.forward_extend(q, k, v, fixture.actual_module.attn, fixture.forward_batch, sinks=torch.ones(4))
    with pytest.raises(UnsupportedFeatureError, match="extra attention arguments k_scale"):
        fixture.backend.forward_extend(q, k, v, fixture.actual_module.attn, fixture.forward_batch, k_scale=1.5)


def test_a_custom_mask_outside_target_verify_is_refused_not_ignored() -> None:
    fixture = _fixture()
    fixture.forward_batch.spec_info = SimpleNamespace(custom_mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(UnsupportedFeatureError, match="custom attention masks in a EXTEND batch"):
        fixture.backend.init_forward_metadata(fixture.forward_batch)


def test_cuda_graph_capture_is_refused_with_the_way_out() -> None:
    backend = _fixture("attnhost_torch_native").backend
    with pytest.raises(
        UnsupportedFeatureError, match=r"graph capture \(it declares no cuda_graph.*--disable-cuda-graph"
    ):
        backend.init_cuda_graph_state(8, 64)
    with pytest.raises(UnsupportedFeatureError, match="graph capture"):
        backend.init_cpu_graph_state(8, 8)
    with pytest.raises(UnsupportedFeatureError, match="graph capture"):
        backend.init_forward_metadata_out_graph(None, in_capture=True)


def _adapter_declaring(fixture, factory: type, flat_heads: bool) -> SGLangAdapterBackend:  # type: ignore[no-untyped-def]
    """An adapter over ``factory`` as the bridge builds it, with ``flat_heads`` declared as given."""
    return SGLangAdapterBackend(
        fixture.runner,
        engine_name="flat_probe",
        attnhost_name="flat_probe",
        origin="plugin 'probe'",
        factory=factory,
        capabilities=BackendCapabilities(flat_heads=flat_heads),
    )


def test_flat_heads_passes_sglangs_layout_through_and_computes_the_same() -> None:
    fixture = _fixture()
    q, k, v = _qkv(fixture)
    outputs = []
    for flat_heads in (True, False):
        adapter = _adapter_declaring(fixture, TorchNativeAttnBackend, flat_heads)
        adapter.init_forward_metadata(fixture.forward_batch)
        outputs.append(adapter.forward(q, k, v, fixture.actual_module.attn, fixture.forward_batch, save_kv_cache=False))
    assert outputs[0].shape == outputs[1].shape == q.shape
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


def test_a_backend_that_breaks_its_flat_heads_declaration_is_named() -> None:
    """A [T, heads, head_dim] answer after declaring flat_heads: one clear error, not a shape error in o_proj."""
    fixture = _fixture()
    liar = _adapter_declaring(fixture, TinyAttnBackend, True)  # the example answers [T, heads, head_dim]
    liar.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    with pytest.raises(
        RuntimeError, match=r"attnhost backend 'flat_probe' \(plugin 'probe'\).* declares flat_heads but returned shape"
    ):
        liar.forward(q, k, v, fixture.actual_module.attn, fixture.forward_batch)


def test_an_idle_batch_gives_an_empty_result() -> None:
    fixture = _fixture()
    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        input_ids=torch.empty(0, dtype=torch.int64),
        req_pool_indices=torch.empty(0, dtype=torch.int32),
        seq_lens=torch.empty(0, dtype=torch.int32),
        out_cache_loc=torch.empty(0, dtype=torch.int64),
        seq_lens_sum=0,
    )
    fixture.backend.init_forward_metadata(idle)
    out = fixture.backend.forward(
        torch.empty(0, 64), torch.empty(0, 4, 16), torch.empty(0, 4, 16), fixture.actual_module.attn, idle
    )
    assert out.shape == (0, 64)


def test_sglangs_stamps_reach_the_attnhost_backend_and_runners_do_not_share() -> None:
    first, second = _fixture(), _fixture()
    assert isinstance(first.backend, SGLangAdapterBackend)
    first.backend.prefill_attention_backend_str = "tiny"
    first.backend.decode_attention_backend_str = "batched_matmul"
    inner = first.backend.attnhost_backend
    assert (inner.prefill_attention_backend_str, inner.decode_attention_backend_str) == ("tiny", "batched_matmul")
    assert second.backend.attnhost_backend is not inner
    assert second.backend.attnhost_backend.decode_attention_backend_str is None


def _ours_and_sglangs(case: DenseAttentionCase, mode: ForwardMode | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's output and SGLang's own torch_native's, on the very same pools and batch."""
    with torch.no_grad():
        fixture = build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)
        batch, layer = fixture.forward_batch, fixture.actual_module.attn
        if mode is not None:
            batch.forward_mode = mode
        sglang_backend = ATTENTION_BACKENDS["torch_native"](fixture.runner)
        q, k, v = _qkv(fixture)
        outputs = []
        for backend in (fixture.backend, sglang_backend):
            backend.init_forward_metadata(batch)
            outputs.append(backend.forward(q, k, v, layer, batch))
    return outputs[0], outputs[1]


def test_a_decode_batch_computes_the_same_as_sglangs_torch_native() -> None:
    """Independent of the kit's reference: SGLang's own backend on the very same pools and batch."""
    case = DenseAttentionCase(
        name="gqa_decode",
        backend="tiny",
        forward_mode=ForwardMode.DECODE,
        num_heads=4,
        num_kv_heads=2,
        page_size=16,
        prefix_lens=(14, 15, 16),
    )
    ours, theirs = _ours_and_sglangs(case)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_mixed_batch_computes_the_same_as_sglangs_torch_native() -> None:
    """Chunked prefill mixed with decode (SGLang's MIXED): extend lengths of 1 beside longer ones."""
    case = DenseAttentionCase(
        name="mixed",
        backend="batched_matmul",
        forward_mode=ForwardMode.EXTEND,
        num_heads=4,
        num_kv_heads=2,
        page_size=16,
        prefix_lens=(0, 15, 20),
        extend_lens=(9, 1, 1),
    )
    ours, theirs = _ours_and_sglangs(case, ForwardMode.MIXED)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [0, 9], ids=["extend", "decode"])
def test_forward_dispatches_as_sglangs_own_forward_once_planned(case: int) -> None:
    """The adapter's ``forward`` picks decode or extend once per planned batch (not by mode tests per layer), and
    still through the methods by name, so a hook on them runs; another batch object goes through SGLang's own
    dispatch and its checks."""
    fixture = _fixture(index=case)
    backend, batch, layer = fixture.backend, fixture.forward_batch, fixture.actual_module.attn
    decode = batch.forward_mode.is_decode()
    backend.init_forward_metadata(batch)
    q, k, v = _qkv(fixture)
    expected = SGLangAttentionBackend.forward(backend, q, k, v, layer, batch, save_kv_cache=False)
    called: list[str] = []
    for name in ("forward_decode", "forward_extend"):
        method = getattr(backend, name)
        setattr(backend, name, lambda *a, _m=method, _n=name, **kw: (called.append(_n), _m(*a, **kw))[1])
    out = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    assert called == ["forward_decode" if decode else "forward_extend"]
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    other = dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc + 1)
    with pytest.raises(RuntimeError, match=r"init_forward_metadata\(\) was not called for this ForwardBatch"):
        backend.forward(q, k, v, layer, other, save_kv_cache=False)
    assert called[1:] == ["forward_decode" if decode else "forward_extend"]


def test_a_draft_runners_refusal_names_the_draft_flag() -> None:
    """The draft's backend comes from ``--speculative-draft-attention-backend``: its refusals say so, way out too."""
    fixture = _fixture()
    fixture.runner.is_draft_worker = True
    adapter = SGLangAdapterBackend(
        fixture.runner,
        engine_name="plain_draft",
        attnhost_name="plain_draft",
        origin="plugin 'probe'",
        factory=TorchNativeAttnBackend,
        capabilities=BackendCapabilities(),
        capable_peers=lambda needs: ["attnhost_torch_native"],
    )
    layer = fixture.actual_module.attn
    layer.logit_cap = 30.0
    adapter.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    flag = "--speculative-draft-attention-backend"
    expected = (
        rf"SGLang {flag} 'plain_draft' does not support .*logit soft-capping.*; "
        rf"choose with {flag} a backend that declares logit_cap, e\.g\. attnhost_torch_native$"
    )
    with pytest.raises(UnsupportedFeatureError, match=expected):
        adapter.forward(q, k, v, layer, fixture.forward_batch)
