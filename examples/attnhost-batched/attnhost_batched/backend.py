"""``batched_matmul``: every request of a batch attended at once, with padding and one mask.

``torch_native`` loops over requests and calls SDPA per request. This backend
instead pads the batch into rectangles — queries ``[B, T, ...]`` with
``T = max new tokens``, keys ``[B, L, ...]`` with ``L = max sequence length``
— and runs one matmul, one softmax and one matmul for all of it. A single
boolean mask ``[B, T, L]`` carries both causality (query ``t`` of request
``b`` sees key ``j`` iff ``j <= prefix_b + t``) and padding (``j < seq_b``);
in a speculative tree (``forward_batch.tree_mask``) each request's block of
the tree replaces causality among its new tokens. A tree row that is all
False in a request without a prefix leaves its query no key at all; the
contract gives such a query zeros, so the plan finds those rows once and the
layers zero them (a softmax over no key would be 0/0).

Everything that depends only on the batch (gather indices, the mask, where
each real query sits in the padded layout) is built once in
``init_forward_metadata``; each layer then does a gather, the three big ops
and a scatter back. GQA is a broadcast: queries are viewed as
``[B, kv_heads, group, T, D]`` against keys ``[B, kv_heads, 1, L, D]``, so KV
heads are never copied per query head. Scores and softmax run in float32
even for bfloat16 inputs, as fused kernels accumulate.

It also serves MLA models (DeepSeek, Kimi; docs/mla.md) on the same plan: the
kernels of both MLA forms are in :mod:`attnhost_batched.mla`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnhost import AttentionBackend, AttentionLayer, BackendCapabilities
from attnhost_batched.mla import attend_latent, attend_mha

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost import AttentionRunner, ForwardBatch

__all__ = ["BatchedMatmulAttnBackend"]


@dataclass(frozen=True, slots=True)
class _Metadata:
    batch: ForwardBatch
    key_slots: torch.Tensor  # [B, L] cache slot of every (request, key position); padding points at slot 0
    blocked: torch.Tensor  # [B, T, L] True where the query may NOT attend to the key (masked to -inf)
    query_valid: torch.Tensor  # [B, T] True for real (not padding) query rows, in token order
    query_rows: torch.Tensor  # [tokens] where each real query sits in the padded layout flattened to [B * T]
    blind: torch.Tensor | None  # [B, 1, 1, T, 1] True for a query that sees no key (output zeros); None: none does
    prefixed: tuple[int, int] | None  # (request, prefix length) of the first request with a cached prefix


class BatchedMatmulAttnBackend(AttentionBackend):
    """Padded, masked, batched matmul attention over a token-slot KV cache."""

    # tree_mask: it honours ForwardBatch.tree_mask (trees, not only chains); mla: both MLA forms (docs/mla.md)
    capabilities = BackendCapabilities(tree_mask=True, mla=True)

    def __init__(self, runner: AttentionRunner | None = None) -> None:
        super().__init__(runner)
        self._metadata: _Metadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the padded layout and the mask once per batch; every layer reuses them."""
        if forward_batch.batch_size == 0:
            self._metadata = None
            return
        device = forward_batch.kv_pool.device
        max_keys = max(forward_batch.seq_lens_cpu)
        max_queries = max(forward_batch.extend_seq_lens_cpu)
        table = forward_batch.kv_pool.req_to_token
        key_pos = torch.arange(max_keys, device=device)
        key_valid = key_pos.unsqueeze(0) < forward_batch.seq_lens.unsqueeze(1)  # [B, L]
        rows = table.index_select(0, forward_batch.req_pool_indices)[:, :max_keys]
        key_slots = torch.where(key_valid, rows, torch.zeros_like(rows))
        query_idx = torch.arange(max_queries, device=device)
        query_valid = query_idx.unsqueeze(0) < forward_batch.extend_seq_lens.unsqueeze(1)  # [B, T]
        query_pos = forward_batch.prefix_lens.unsqueeze(1) + query_idx.unsqueeze(0)  # absolute positions
        causal = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # [B, T, L]
        blind = None
        if forward_batch.tree_mask is not None:
            _apply_tree(causal, forward_batch)
            seen = causal.any(dim=-1, keepdim=True)  # [B, T, 1]; a causal row always sees key 0 (position 0)
            if not bool(seen.all()):  # a tree row all False without a prefix: one sync per tree batch
                blind = ~seen
                causal |= blind & (key_pos == 0)  # it reads key 0, so softmax never sees an all-masked row
                blind = blind.view(forward_batch.batch_size, 1, 1, max_queries, 1)
        blocked = ~(causal & key_valid.unsqueeze(1))
        query_rows = query_valid.flatten().nonzero().squeeze(1)  # once per batch, not a boolean scatter per layer
        prefixed = next(((i, n) for i, n in enumerate(forward_batch.prefix_lens_cpu) if n), None)
        self._metadata = _Metadata(forward_batch, key_slots, blocked, query_valid, query_rows, blind, prefixed)

    def _plan(self, forward_batch: ForwardBatch) -> _Metadata:
        meta = self._metadata
        if meta is None or meta.batch is not forward_batch:
            raise RuntimeError("batched_matmul: init_forward_metadata() was not called for this ForwardBatch")
        return meta

    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> Tensor:  # fmt: skip
        meta = self._plan(forward_batch)
        pool = forward_batch.kv_pool
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        if save_kv_cache:
            pool.set_kv(
                layer.layer_id, forward_batch.out_cache_loc, k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
            )
        batch, max_queries = meta.query_valid.shape
        group = layer.num_heads // kv_heads
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

        # [tokens, heads, D] -> padded [B, T, heads, D] -> [B, kv_heads, group, T, D]
        padded_q = q.new_zeros((batch, max_queries, layer.num_heads, dim), dtype=compute)
        padded_q[meta.query_valid] = q.view(-1, layer.num_heads, dim).to(compute)
        padded_q = padded_q.view(batch, max_queries, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        # cache [slots, kv_heads, D] -> [B, L, kv_heads, D] -> [B, kv_heads, 1, L, D]
        keys = pool.k_buffer(layer.layer_id)[meta.key_slots].to(compute).permute(0, 2, 1, 3).unsqueeze(2)
        values = pool.v_buffer(layer.layer_id)[meta.key_slots].to(compute).permute(0, 2, 1, 3).unsqueeze(2)

        scores = torch.matmul(padded_q, keys.transpose(-1, -2)) * layer.scaling  # [B, kv_heads, group, T, L]
        scores = scores.masked_fill(meta.blocked.view(batch, 1, 1, max_queries, -1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, kv_heads, group, T, D]
        if meta.blind is not None:  # a query that sees no key gets zeros (it read key 0 only to keep softmax finite)
            out = out.masked_fill(meta.blind, 0.0)

        out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_queries, layer.num_heads, dim)
        return out[meta.query_valid].to(q.dtype)

    def forward_mla_mha(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer,
                        forward_batch: ForwardBatch) -> Tensor:  # fmt: skip
        """MLA's MHA form: causal attention over the ``k``/``v`` arguments; the caller has written the latent."""
        meta = self._plan(forward_batch)
        if meta.prefixed is not None:
            request, prefix = meta.prefixed
            raise ValueError(
                f"batched_matmul: MLA's MHA form attends over its k/v arguments only, but request {request} of this "
                f"{forward_batch.forward_mode.name} batch has a cached prefix of {prefix} tokens; call the absorbed "
                "form (an MLAForm.ABSORBED layer) for requests with a prefix"
            )
        heads, qk_dim, v_dim = layer.num_heads, layer.head_dim, layer.v_head_dim
        out = attend_mha(meta, q.view(-1, heads, qk_dim), k.view(-1, heads, qk_dim), v.view(-1, heads, v_dim), layer)
        return out.view(-1, heads * v_dim) if q.dim() == 2 else out

    def forward_mla_mqa(self, q: Tensor, k: Tensor | None, v: Tensor | None, layer: AttentionLayer,
                        forward_batch: ForwardBatch, save_kv_cache: bool = True, q_rope: Tensor | None = None,
                        k_rope: Tensor | None = None) -> Tensor:  # fmt: skip
        """MLA's absorbed form: write the new latent rows when asked, then attend over every request's rows."""
        meta = self._plan(forward_batch)
        mla = layer.mla
        if mla is None:
            raise ValueError(f"layer {layer.layer_id} is not an MLA layer; build it with AttentionLayer.for_mla()")
        rank, width, heads = mla.kv_lora_rank, mla.latent_dim, layer.num_heads
        pool = forward_batch.kv_pool
        if save_kv_cache:
            if k is None:
                raise ValueError(
                    f"batched_matmul: save_kv_cache=True but no k (the new latent rows) for MLA layer "
                    f"{layer.layer_id}; pass them, or save_kv_cache=False if the caller wrote them"
                )
            row = k if k_rope is None else torch.cat([k.reshape(-1, 1, rank), k_rope.reshape(-1, 1, width - rank)], -1)
            row = row.reshape(-1, 1, width)
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, row, row[..., :rank])
        if q_rope is None:
            out = attend_latent(meta, q.view(-1, heads, width), None, pool.k_buffer(layer.layer_id), layer, rank)
        else:
            query, rope = q.reshape(-1, heads, rank), q_rope.reshape(-1, heads, width - rank)
            out = attend_latent(meta, query, rope, pool.k_buffer(layer.layer_id), layer, rank)
        return out.view(-1, heads * rank) if q.dim() == 2 else out


def _apply_tree(causal: torch.Tensor, forward_batch: ForwardBatch) -> None:
    """Overwrite each request's new-token columns of ``causal`` with its block of the tree mask (per batch)."""
    assert forward_batch.tree_mask is not None
    lens = forward_batch.extend_seq_lens_cpu
    blocks = forward_batch.tree_mask.split_with_sizes([new * new for new in lens])
    for b, (prefix, new, block) in enumerate(zip(forward_batch.prefix_lens_cpu, lens, blocks, strict=True)):
        causal[b, :new, prefix : prefix + new] = block.view(new, new)
