"""The backend contract: ``forward_extend`` is required, ``forward_decode`` defaults to it."""

from __future__ import annotations

import pytest
import torch

from attnhost import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode, KVPool
from attnhost.testing.reference import reference_attention


class ExtendOnly(AttentionBackend):
    """Implements the one attention method a backend needs, and records which batches reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self.calls.append(forward_batch.forward_mode.name)
        if save_kv_cache:
            forward_batch.kv_pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return reference_attention(q, layer, forward_batch).to(q.dtype)


def test_a_backend_without_forward_extend_cannot_be_instantiated() -> None:
    class DecodeOnly(AttentionBackend):
        def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
            pass

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
            return q

    with pytest.raises(TypeError, match="forward_extend"):
        DecodeOnly()  # type: ignore[abstract]


def test_forward_decode_defaults_to_forward_extend() -> None:
    torch.manual_seed(0)
    pool = KVPool(1, 64, 2, 8, max_requests=2, max_context_len=32)
    layer = AttentionLayer(0, 4, 2, 8)
    backend = ExtendOnly()
    req = pool.alloc_request()
    for mode, triple in ((ForwardMode.EXTEND, (req, 0, 5)), (ForwardMode.DECODE, (req, 5, 1))):
        batch = ForwardBatch.prepare(pool, mode, [triple])
        n = batch.num_new_tokens
        q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        assert backend.forward(q, k, v, layer, batch).shape == (n, 4, 8)
        assert backend.forward_decode(q, k, v, layer, batch, save_kv_cache=False).shape == (n, 4, 8)
    # forward() and forward_decode() both reach forward_extend, the one method implemented
    assert backend.calls == ["EXTEND", "EXTEND", "DECODE", "DECODE"]
