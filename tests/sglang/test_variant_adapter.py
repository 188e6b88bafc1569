"""The adapter's attention variants, in process, on SGLang's own dense-kit fixtures (real pools, real
``RadixAttention``): a layer's window, soft-cap, ``attn_type`` and ``sinks=`` reach the attnhost backend as the
float64 reference computes them; what the contract cannot express is refused by name.

(End to end, with SGLang's hybrid window pool and real Gemma / gpt-oss models: ``test_variants_engine.py``.)
"""

from __future__ import annotations

import dataclasses
import unittest

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    build_dense_attention_fixture,
    make_dense_cases,
)

from attnhost.engines.sglang.adapter import UnsupportedFeatureError  # noqa: E402
from attnhost.errors import InvalidBatchError  # noqa: E402
from attnhost.testing.reference import reference_attention  # noqa: E402

BACKEND = "attnhost_torch_native"


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _fixture(backend: str = BACKEND):  # type: ignore[no-untyped-def]
    """SGLang's extend case with prefixes and new tokens longer than the windows below (three requests)."""
    [case] = [c for c in make_dense_cases(backend) if c.name == "mha_extend_ragged_page_boundary"]
    with torch.no_grad():
        return build_dense_attention_fixture(_KitCase(), dataclasses.replace(case), device="cpu", dtype=torch.float32)


def _qkv(fixture, scale: float = 1.0):  # type: ignore[no-untyped-def]
    case, attn = fixture.case, fixture.actual_module.attn
    torch.manual_seed(7)
    tokens = case.num_input_tokens
    return (
        torch.randn(tokens, case.num_heads * attn.head_dim) * scale,
        torch.randn(tokens, case.num_kv_heads, attn.head_dim) * scale,
        torch.randn(tokens, case.num_kv_heads, attn.head_dim),
    )


@pytest.mark.parametrize(
    ("window", "cap", "encoder_only", "with_sinks"),
    [
        (3, 0.0, False, False),
        (-1, 2.0, False, False),
        (-1, 0.0, True, False),
        (-1, 0.0, False, True),
        (5, 3.0, False, True),
    ],
    ids=["window", "cap", "encoder-only", "sinks", "all"],
)
def test_a_layers_variants_reach_the_backend_as_the_reference_computes(
    window: int, cap: float, encoder_only: bool, with_sinks: bool
) -> None:
    fixture = _fixture()
    layer = fixture.actual_module.attn
    layer.sliding_window_size, layer.logit_cap = window, cap
    if encoder_only:
        layer.attn_type = AttentionType.ENCODER_ONLY
    adapter = fixture.backend
    adapter.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture, scale=3.0)
    sinks = (torch.randn(fixture.case.num_heads) * 2).to(torch.bfloat16) if with_sinks else None
    extra = {"sinks": sinks} if with_sinks else {}
    out = adapter.forward_extend(q, k, v, layer, fixture.forward_batch, **extra)

    facts = adapter._layers[layer.layer_id]
    assert (facts.sliding_window_size, facts.logit_cap, facts.is_causal, facts.has_sinks) == (
        window,
        cap,
        not encoder_only,
        with_sinks,
    )
    expected = reference_attention(q, facts, adapter._batch, sinks=None if sinks is None else sinks.float())
    torch.testing.assert_close(out.view_as(expected).double(), expected, atol=2e-5, rtol=2e-5)
    plain = reference_attention(
        q,
        dataclasses.replace(facts, sliding_window_size=-1, logit_cap=0.0, has_sinks=False, is_causal=True),
        adapter._batch,
    )
    assert not torch.allclose(out.view_as(plain).double(), plain, atol=1e-3), "the variant changed nothing"


def test_bfloat16_sinks_become_float32_once_per_weight_version() -> None:
    fixture = _fixture()
    layer, adapter = fixture.actual_module.attn, fixture.backend
    adapter.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    sinks = torch.randn(fixture.case.num_heads).to(torch.bfloat16)
    adapter.forward_extend(q, k, v, layer, fixture.forward_batch, save_kv_cache=False, sinks=sinks)
    passed = adapter._sinks[layer.layer_id][2]
    assert passed.dtype == torch.float32 and torch.equal(passed, sinks.float())
    adapter.forward_extend(q, k, v, layer, fixture.forward_batch, save_kv_cache=False, sinks=sinks)
    assert adapter._sinks[layer.layer_id][2] is passed  # no conversion per call
    sinks.add_(1.0)  # an in-place weight update
    adapter.forward_extend(q, k, v, layer, fixture.forward_batch, save_kv_cache=False, sinks=sinks)
    assert torch.equal(adapter._sinks[layer.layer_id][2], sinks.float())


def test_a_sinks_layer_called_without_sinks_is_refused() -> None:
    fixture = _fixture()
    layer, adapter = fixture.actual_module.attn, fixture.backend
    adapter.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    adapter.forward_extend(q, k, v, layer, fixture.forward_batch, save_kv_cache=False, sinks=torch.zeros(4))
    with pytest.raises(InvalidBatchError, match=r"layer 0 was called without sinks= although its attention module"):
        adapter.forward_extend(q, k, v, layer, fixture.forward_batch, save_kv_cache=False)
    with pytest.raises(InvalidBatchError, match=r"sinks of shape \(3,\), not one per query head of this rank \(4,\)"):
        fixture2 = _fixture()
        fixture2.backend.init_forward_metadata(fixture2.forward_batch)
        fixture2.backend.forward_extend(
            q, k, v, fixture2.actual_module.attn, fixture2.forward_batch, save_kv_cache=False, sinks=torch.zeros(3)
        )


@pytest.mark.parametrize(
    ("attribute", "value", "words"),
    [
        ("logit_capping_method", "sigmoid", "the logit-capping method 'sigmoid'"),
        ("attn_type", AttentionType.DECODER_BIDIRECTIONAL, "decoder_bidirectional attention"),
    ],
)
def test_what_the_contract_cannot_express_is_refused_by_name(attribute: str, value: object, words: str) -> None:
    fixture = _fixture()
    layer = fixture.actual_module.attn
    layer.logit_cap = 5.0
    setattr(layer, attribute, value)
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    with pytest.raises(UnsupportedFeatureError, match=f"'{BACKEND}'.*does not support {words}"):
        fixture.backend.forward_extend(q, k, v, layer, fixture.forward_batch)


def test_a_query_sglang_hands_per_head_gets_the_flat_result_it_expects() -> None:
    """Gemma 3 normalizes ``q`` per head and hands it over as ``[tokens, heads, head_dim]``: a backend that declares
    ``flat_heads`` (torch_native) is then called in the per-head layout, and SGLang still gets ``[tokens, heads *
    head_dim]``, the numbers of the flat call."""
    fixture = _fixture()
    layer, adapter = fixture.actual_module.attn, fixture.backend
    layer.sliding_window_size = 3
    assert adapter.capabilities.flat_heads
    adapter.init_forward_metadata(fixture.forward_batch)
    q, k, v = _qkv(fixture)
    flat = adapter.forward_extend(q, k, v, layer, fixture.forward_batch)
    per_head = adapter.forward_extend(q.view(q.shape[0], -1, layer.head_dim), k, v, layer, fixture.forward_batch)
    assert per_head.shape == flat.shape == q.shape
    torch.testing.assert_close(per_head, flat, atol=0, rtol=0)
