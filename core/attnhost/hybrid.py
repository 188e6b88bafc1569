"""A target backend made of two, for when the prefill and decode attention backends differ: it routes by
:func:`attnhost.forward_mode.per_mode`, as dispatch does, so the kernel that runs is the one reported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnhost.backend import AttentionBackend, AttentionLayer, BackendCapabilities
from attnhost.forward_mode import per_mode

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost.forward_batch import ForwardBatch

__all__ = ["HybridAttnBackend"]


class HybridAttnBackend(AttentionBackend):
    """Holds a prefill and a decode backend and sends each forward to the right one."""

    capabilities = BackendCapabilities(sinks=True)
    """A container: sinks pass through it to the backend of the mode, whose own declaration decides."""

    def __init__(
        self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend, speculative_attention_mode: str
    ) -> None:
        super().__init__()
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self._by_mode = per_mode(prefill_backend, decode_backend, speculative_attention_mode)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._by_mode[forward_batch.forward_mode].init_forward_metadata(forward_batch)

    def forward_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        sinks: Tensor | None = None,
    ) -> Tensor:
        # The sub-backend's forward() picks its decode or extend method, so this serves both (forward_decode too);
        # sinks go on only when given, as forward() passes them.
        backend = self._by_mode[forward_batch.forward_mode]
        if sinks is not None:
            return backend.forward(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)
        return backend.forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_mla_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        return self._by_mode[forward_batch.forward_mode].forward_mla_mha(q, k, v, layer, forward_batch)

    def forward_mla_mqa(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        q_rope: Tensor | None = None,
        k_rope: Tensor | None = None,
    ) -> Tensor:
        backend = self._by_mode[forward_batch.forward_mode]
        return backend.forward_mla_mqa(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)
