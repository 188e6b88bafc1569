"""vLLM's full CUDA graphs over an attnhost backend that declares graph support (docs/graphs.md).

vLLM captures, per batch size, the whole forward of a *uniform* batch (every request with the same query length:
one token in a decode, ``1 + num_speculative_tokens`` in a speculative verify; ``AttentionCGSupport.UNIFORM_BATCH``)
and replays it on new values. Before capture and before every replay it asks the metadata builder for the
batch's metadata; the graph then reads that metadata by address. A replayed batch is padded to the captured size
vLLM's way: requests past the live ones have no query token (``query_start_loc`` repeats its last value), a length
of 0 and the null block (0) in their block-table row; the tokens past the live ones carry slot ``-1``.

This module owns one set of buffers, allocated once for the largest batch vLLM may capture, and one attnhost
``ForwardBatch`` per (batch size, query length) over views of them: every uniform step copies vLLM's lengths, block
table and slot mapping into the buffers in place (no host read) and hands the backend the same batch object, which
it re-plans in place. A padded request becomes a row as SGLang pads them: ``q`` new tokens over the null block's
first slots, its tokens' slot ``-1`` (the impl writes such a row nowhere); its output is computed harmlessly and
discarded. The host lengths of a graph batch are bounds (the block table's width in tokens), the same at every
step; the exact lengths are on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache

__all__ = ["UniformBatches"]

Cache = TypeVar("Cache", bound=KVCache)


@dataclass(frozen=True, slots=True)
class _Buffers:
    """The largest uniform batch's device buffers; each batch size's views of them keep their storage."""

    seq_lens: torch.Tensor  # [max_tokens] int64
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    rows: torch.Tensor  # 0 .. max_tokens - 1: the batch's rows of its own tables
    out_cache_loc: torch.Tensor  # [max_tokens] int64
    pages: torch.Tensor  # [max_tokens, blocks] int64: vLLM's block table
    req_to_token: torch.Tensor  # [max_tokens, blocks * block_size] int64: the block table at token level


class UniformBatches(Generic[Cache]):
    """The persistent attnhost batches of one metadata builder's uniform (graph-capturable) vLLM batches.

    ``max_tokens``: the most tokens vLLM captures in one graph (its largest capture size). The buffers are allocated
    at the first uniform batch, as wide as vLLM's block table (``max_model_len`` in blocks, the same at every
    step): that width in tokens bounds every request's length on the host.
    """

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_tokens: int,
        make_kv: Callable[[torch.Tensor], Cache],
    ) -> None:
        self.device = device
        self.make_kv = make_kv
        """The attnhost cache over vLLM's tensors, given a batch's ``req_to_token``."""
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._buffers: _Buffers | None = None
        self._batches: dict[tuple[int, int], tuple[ForwardBatch, Cache]] = {}
        self._offsets = torch.arange(block_size, dtype=torch.int64, device=device)

    def uniform_query_len(self, m: Any, query_lens: list[int]) -> int | None:
        """The query length every live request of ``m`` has, when ``m`` is a uniform batch these buffers hold (its
        padded requests without tokens, every token a request's); ``None`` for any other batch."""
        q = query_lens[0] if query_lens else 0
        n = int(m.num_reqs)
        if q < 1 or any(length != q for length in query_lens) or n * q > self.max_tokens:
            return None
        if int(m.num_actual_tokens) < n * q:
            return None
        width = m.block_table_tensor.shape[1]
        if width < 1 or (self._buffers is not None and width > self._buffers.pages.shape[1]):
            return None
        return q

    def refresh(self, m: Any, q: int) -> tuple[ForwardBatch, Cache]:
        """vLLM's uniform batch ``m`` (``num_reqs`` requests of ``q`` query tokens, padded ones included) copied into
        the buffers in place, and the attnhost batch of its size and its cache, the same objects at every step of
        that size."""
        n = int(m.num_reqs)
        table = m.block_table_tensor
        buffers = self._buffers or self._allocate(table.shape[1])
        tokens = n * q
        seq_lens, prefix_lens = buffers.seq_lens[:n], buffers.prefix_lens[:n]
        # a padded request (length 0, no token) becomes a row of q tokens over the null block's first slots
        seq_lens.copy_(m.seq_lens[:n]).clamp_(min=q)
        torch.sub(seq_lens, q, out=prefix_lens)
        buffers.extend_lens[:n].fill_(q)  # shared with the other query lengths' batches: set every step
        buffers.out_cache_loc[:tokens].copy_(m.slot_mapping[:tokens])
        blocks, width = buffers.pages.shape[1], table.shape[1]
        pages = buffers.pages[:n]
        pages[:, :width].copy_(table[:n])
        if width < blocks:
            pages[:, width:].zero_()  # the null block
        tokens_view = buffers.req_to_token[:n].view(n, blocks, self.block_size)
        torch.add(pages.unsqueeze(-1) * self.block_size, self._offsets, out=tokens_view)
        held = self._batches.get((n, q))
        if held is None:
            held = self._batches[(n, q)] = self._batch(buffers, n, q)
        return held

    def holds(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is one of these persistent batches (what vLLM's graphs may capture and replay)."""
        return any(batch is held for held, _ in self._batches.values())

    def _allocate(self, blocks: int) -> _Buffers:
        device, size = self.device, self.max_tokens

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self._buffers = _Buffers(
            seq_lens=zeros(size),
            prefix_lens=zeros(size),
            extend_lens=zeros(size),
            rows=torch.arange(size, dtype=torch.int64, device=device),
            out_cache_loc=zeros(size),
            pages=zeros(size, blocks),
            req_to_token=zeros(size, blocks * self.block_size),
        )
        return self._buffers

    def _batch(self, buffers: _Buffers, n: int, q: int) -> tuple[ForwardBatch, Cache]:
        bound = buffers.req_to_token.shape[1]
        kv = self.make_kv(buffers.req_to_token[:n])
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE if q == 1 else ForwardMode.EXTEND,
            kv_pool=kv,
            req_pool_indices=buffers.rows[:n],
            seq_lens=buffers.seq_lens[:n],
            prefix_lens=buffers.prefix_lens[:n],
            extend_seq_lens=buffers.extend_lens[:n],
            out_cache_loc=buffers.out_cache_loc[: n * q],
            seq_lens_cpu=(bound,) * n,
            prefix_lens_cpu=(bound - q,) * n,
            extend_seq_lens_cpu=(q,) * n,
            host_lengths_exact=False,
            pages=buffers.pages[:n],  # vLLM's block table, as the ordinary batches carry it
        )
        return batch, kv
