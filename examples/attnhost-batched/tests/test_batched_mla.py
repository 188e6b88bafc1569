"""What the conformance kit does not ask of ``batched_matmul``'s MLA forms: misuse is refused in one sentence."""

from __future__ import annotations

import pytest
import torch

from attnhost import ForwardMode, ModelRunner, ServerArgs
from attnhost.mla import MLAConfig

MLA = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)


def _runner() -> ModelRunner:
    return ModelRunner(ServerArgs(attention_backend="batched_matmul"), num_layers=1, num_heads=4, mla=MLA)


def test_the_mha_form_refuses_a_request_with_a_cached_prefix_by_index() -> None:
    runner = _runner()
    fresh, cached = runner.new_request(), runner.new_request()
    batch = runner.prepare_batch(ForwardMode.EXTEND, [(fresh, 0, 3), (cached, 5, 2)])
    [layer] = runner.mha_layers
    q = k = torch.randn(batch.num_new_tokens, 4, MLA.qk_head_dim)
    v = torch.randn(batch.num_new_tokens, 4, MLA.v_head_dim)
    with runner.forward_context() as backend, pytest.raises(ValueError) as refused:
        backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    message = str(refused.value)
    assert "batched_matmul" in message and "request 1" in message and "prefix of 5 tokens" in message, message
    assert "absorbed" in message, message  # the way out


def test_the_absorbed_form_refuses_to_save_without_the_new_rows() -> None:
    runner = _runner()
    batch = runner.prepare_batch(ForwardMode.DECODE, [(runner.new_request(), 4, 1)])
    [layer] = runner.layers
    q = torch.randn(1, 4, MLA.latent_dim)
    with runner.forward_context() as backend, pytest.raises(ValueError, match=r"batched_matmul.*no k.*layer 0"):
        backend.forward(q, None, None, layer, batch, save_kv_cache=True)


def test_flat_queries_come_back_flat_and_equal_the_headed_result() -> None:
    runner = _runner()
    batch = runner.prepare_batch(ForwardMode.EXTEND, [(runner.new_request(), 0, 5), (runner.new_request(), 0, 2)])
    [layer] = runner.layers
    q, k = torch.randn(7, 4, MLA.latent_dim), torch.randn(7, 1, MLA.latent_dim)
    with torch.no_grad(), runner.forward_context() as backend:
        headed = backend.forward(q, k, k[..., : MLA.kv_lora_rank], layer, batch)
        flat = backend.forward(q.flatten(1), k, k[..., : MLA.kv_lora_rank], layer, batch)
    assert flat.shape == (7, 4 * MLA.kv_lora_rank)
    torch.testing.assert_close(flat.view(7, 4, MLA.kv_lora_rank), headed)
