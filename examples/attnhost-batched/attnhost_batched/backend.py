"""``batched_matmul``: every request of a batch attended at once, with padding and one mask.

``torch_native`` loops over requests and calls SDPA per request. This backend
instead pads the batch into rectangles — queries ``[B, T, ...]`` with
``T = max new tokens``, keys ``[B, L, ...]`` with ``L`` the longest run of keys
any request may read — and runs one matmul, one softmax and one matmul for all
of it. One boolean mask ``[B, T, L]`` carries causality (query ``t`` of
request ``b`` sees key ``j`` iff ``j <= prefix_b + t``), padding (``j <
seq_b``) and the layer's variants (docs/variants.md); in a speculative tree
(``forward_batch.tree_mask``) each request's block of the tree replaces
causality among its new tokens. A tree row that is all False in a request
without a prefix (or whose window leaves it nothing) leaves its query no key
at all; the contract gives such a query zeros, so the plan finds those rows
once and the layers zero them (a softmax over no key would be 0/0).

The variants, each with its own code here (the point of an example):

* A sliding window of ``w`` (``sliding_window_size``) restricts the key axis
  itself: request ``b`` reads keys from index ``max(0, prefix_b - w)`` on, as
  no query of its can see an earlier one, so a decode step gathers ``w + 1``
  keys however long its sequence. Within that span the mask keeps the keys
  whose position is at most ``w`` before the query's; in a tree a new token's
  position is its prefix plus its depth, so the plan computes depths once.
* ``is_causal=False`` makes every key of a request visible to its new tokens
  (a window still limits the left side); a tree batch is refused for such a
  layer, as a tree over a bidirectional layer means nothing.
* A logit cap ``c`` maps the scores to ``c * tanh(s / c)`` in place, before
  the mask, with the scaling folded into the one multiply.
* Sinks add ``exp(sinks[h])`` to head ``h``'s denominator: the softmax is then
  written out (max, exp, sum), the sink joining the max so nothing overflows.

A batch's layers may differ in window and causality (Gemma 2 alternates
windowed and global layers), so the key plan is built per layer *kind*: at the
first layer of each kind in a batch, then looked up by the rest. Everything
else that depends only on the batch (where each real query sits in the padded
layout) is built once in ``init_forward_metadata``; each layer then does a
gather, the three big ops and a gather back. GQA folds a KV head's query
heads into the query axis: queries ``[kv_heads * B, T * group, D]`` meet keys
gathered straight into ``[kv_heads * B, L, D]`` in one ``bmm``, so a KV head
is never copied per query head (a broadcasting ``matmul`` would expand it).
Scores and softmax run in float32 even for bfloat16 inputs, as fused kernels
accumulate.

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
class _Keys:
    """Which keys the layers of one kind (window, causality) read in this batch, and which of them each query sees."""

    key_slots: torch.Tensor  # [B, L] cache slot of every (request, key column); padding: the request's last
    blocked: torch.Tensor  # [B, T, L] True where the query may NOT attend to the key (masked to -inf)
    blind: torch.Tensor | None  # [B, T] True for a query that sees no key (output zeros); None: none does


@dataclass(frozen=True, slots=True)
class _Metadata:
    batch: ForwardBatch
    query_valid: torch.Tensor  # [B, T] True for real (not padding) query rows, in token order
    query_rows: torch.Tensor  # [tokens] where each real query sits in the padded layout flattened to [B * T]
    prefixed: tuple[int, int] | None  # (request, prefix length) of the first request with a cached prefix
    kinds: dict[tuple[int, bool], _Keys]  # key plans by (sliding_window_size, is_causal), filled as layers come

    def keys(self, layer: AttentionLayer) -> _Keys:
        """The key plan of ``layer``'s kind: built by the first layer of that kind in the batch, reused after."""
        kind = (layer.sliding_window_size, layer.is_causal)
        plan = self.kinds.get(kind)
        if plan is None:
            plan = self.kinds[kind] = _plan_keys(self.batch, self.query_valid, *kind, layer.layer_id)
        return plan

    def refresh(self) -> None:
        """Re-plan the same batch in place (a captured graph's, whose tensors the engine refreshed): every tensor a
        graph may read keeps its storage, only its values change. The host counts cannot have changed (the batch
        is frozen), so every shape is the same."""
        batch = self.batch
        torch.lt(
            torch.arange(self.query_valid.shape[1], device=self.query_valid.device).unsqueeze(0),
            batch.extend_seq_lens.unsqueeze(1),
            out=self.query_valid,
        )
        for (window, causal), keys in self.kinds.items():
            fresh = _plan_keys(batch, self.query_valid, window, causal, -1)
            keys.key_slots.copy_(fresh.key_slots)
            keys.blocked.copy_(fresh.blocked)
            if keys.blind is not None and fresh.blind is not None:
                keys.blind.copy_(fresh.blind)


class BatchedMatmulAttnBackend(AttentionBackend):
    """Padded, masked, batched matmul attention over a token-slot KV cache."""

    # tree_mask: it honours ForwardBatch.tree_mask (trees, not only chains); mla: both MLA forms (docs/mla.md);
    # the four attention variants (docs/variants.md), in any combination and every forward mode; cuda_graph: it
    # reads no device value on the host and plans from host bounds where the engine has no exact lengths
    # (docs/graphs.md), every shape fixed by the host's counts
    capabilities = BackendCapabilities(
        cuda_graph=True, tree_mask=True, mla=True, sliding_window=True, logit_cap=True, sinks=True, non_causal=True
    )

    def __init__(self, runner: AttentionRunner | None = None) -> None:
        super().__init__(runner)
        self._metadata: _Metadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the padded query layout once per batch; each layer kind's keys and mask come at its first layer.
        Nothing is read from the device: the new tokens' counts are exact on the host, and every length that may
        be only a bound there (``host_lengths_exact``) is used as a tensor."""
        if forward_batch.batch_size == 0:
            self._metadata = None
            return
        planned = self._metadata
        if planned is not None and planned.batch is forward_batch:  # a graph step: the same plan, refreshed in place
            planned.refresh()
            return
        device = forward_batch.kv_pool.device
        lens = forward_batch.extend_seq_lens_cpu
        max_queries = max(lens)
        query_idx = torch.arange(max_queries, device=device)
        query_valid = query_idx.unsqueeze(0) < forward_batch.extend_seq_lens.unsqueeze(1)  # [B, T]
        # where each real query sits in the padded layout: from the exact host counts, not a nonzero() (a read)
        rows = [b * max_queries + t for b, n in enumerate(lens) for t in range(n)]
        query_rows = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        prefixed = None
        if forward_batch.host_lengths_exact:
            prefixed = next(((i, n) for i, n in enumerate(forward_batch.prefix_lens_cpu) if n), None)
        self._metadata = _Metadata(forward_batch, query_valid, query_rows, prefixed, {})

    def _plan(self, forward_batch: ForwardBatch) -> _Metadata:
        meta = self._metadata
        if meta is None or meta.batch is not forward_batch:
            raise RuntimeError("batched_matmul: init_forward_metadata() was not called for this ForwardBatch")
        return meta

    def forward_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        sinks: Tensor | None = None,
    ) -> Tensor:
        meta = self._plan(forward_batch)
        if sinks is None and layer.has_sinks:
            raise ValueError(
                f"batched_matmul: layer {layer.layer_id} has attention sinks (has_sinks=True) but was called without "
                "sinks=; pass its [num_heads] sink logits, as SGLang's models do on every call"
            )
        if sinks is not None and tuple(sinks.shape) != (layer.num_heads,):
            raise ValueError(
                f"batched_matmul: layer {layer.layer_id} got sinks of shape {tuple(sinks.shape)}; it needs one logit "
                f"per query head of this rank, shape ({layer.num_heads},)"
            )
        plan = meta.keys(layer)
        pool = forward_batch.kv_pool
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        if save_kv_cache:
            pool.set_kv(
                layer.layer_id, forward_batch.out_cache_loc, k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
            )
        batch, max_queries = meta.query_valid.shape
        heads, group = layer.num_heads, layer.num_heads // kv_heads
        max_keys = plan.key_slots.shape[1]
        compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

        # Batched over (KV head, request), a KV head's query heads folded into the query axis: queries [kv_heads * B,
        # T * group, D] meet keys [kv_heads * B, L, D] in one bmm, so no KV head is ever copied per query head.
        padded_q = q.new_zeros((kv_heads, batch * max_queries, group, dim), dtype=compute)
        padded_q.index_copy_(1, meta.query_rows, q.view(-1, kv_heads, group, dim).transpose(0, 1).to(compute))
        queries = padded_q.view(kv_heads * batch, max_queries * group, dim)
        # cache [slots, kv_heads, D] -> gathered straight into [kv_heads, B * L, D]: only the keys of the plan (an
        # indexing gather reads the strided view in place; index_select would first copy the whole buffer)
        slots = plan.key_slots.flatten()
        keys = pool.k_buffer(layer.layer_id).transpose(0, 1)[:, slots].to(compute)
        values = pool.v_buffer(layer.layer_id).transpose(0, 1)[:, slots].to(compute)

        scores = torch.bmm(queries, keys.reshape(kv_heads * batch, max_keys, dim).transpose(1, 2))
        cap = layer.logit_cap
        if cap > 0:  # cap * tanh(scaling * s / cap), before the mask (tanh(-inf) would unmask)
            scores.mul_(layer.scaling / cap).tanh_().mul_(cap)
        else:
            scores.mul_(layer.scaling)
        per_head = scores.view(kv_heads, batch, max_queries, group, max_keys)  # the same memory, by axis
        per_head.masked_fill_(plan.blocked.view(1, batch, max_queries, 1, max_keys), float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # softmax written out, the sink one more term of the denominator (and of the max, against overflow)
            sink = sinks.to(compute).view(kv_heads, 1, 1, group, 1)
            peak = torch.maximum(per_head.amax(dim=-1, keepdim=True), sink)
            denominator = per_head.sub_(peak).exp_().sum(dim=-1, keepdim=True).add_(sink.sub(peak).exp_())
            probs = scores  # the weights, normalised below on the (narrower) output
        out = torch.bmm(probs, values.reshape(kv_heads * batch, max_keys, dim))  # [kv_heads * B, T * group, D]
        if sinks is not None:
            out.view(kv_heads, batch, max_queries, group, dim).div_(denominator)
        if plan.blind is not None:  # a query that sees no key gets zeros (it read key 0 only to keep softmax finite)
            out.view(kv_heads, batch, max_queries, group, dim).masked_fill_(
                plan.blind.view(1, batch, max_queries, 1, 1), 0.0
            )
        out = out.view(kv_heads, batch * max_queries, group, dim).index_select(1, meta.query_rows)
        return out.transpose(0, 1).reshape(-1, heads, dim).to(q.dtype)

    def forward_mla_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        """MLA's MHA form: causal attention over the ``k``/``v`` arguments; the caller has written the latent."""
        meta = self._plan(forward_batch)
        if not forward_batch.host_lengths_exact:  # bounds on the host: the device says whether a prefix is cached
            torch._assert_async(
                (forward_batch.prefix_lens == 0).all(),
                "batched_matmul: MLA's MHA form attends over its k/v arguments only, but a request of this batch has "
                "a cached prefix; call the absorbed form (an MLAForm.ABSORBED layer) for requests with a prefix",
            )
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


def _plan_keys(
    forward_batch: ForwardBatch, query_valid: torch.Tensor, window: int, causal: bool, layer_id: int
) -> _Keys:
    """The keys each request reads for layers like ``layer`` and the mask over them (once per kind and batch).

    Key column ``c`` of request ``b`` is its key index ``start_b + c``, where ``start_b = max(0, prefix_b - w)``
    under a window ``w`` (no query of the request sees an earlier key: the first new token sits at position
    ``prefix_b``, in a tree too) and ``0`` without one."""
    tree = forward_batch.tree_mask is not None
    if tree and not causal:
        raise ValueError(
            f"batched_matmul: layer {layer_id} is non-causal (is_causal=False) but this "
            f"{forward_batch.forward_mode.name} batch carries a speculative tree (tree_mask), which has no meaning "
            "over a bidirectional layer (docs/variants.md); run the layer in batches without a tree (chains)"
        )
    device = forward_batch.kv_pool.device
    batch, max_queries = query_valid.shape
    prefix = forward_batch.prefix_lens.unsqueeze(1)  # [B, 1], the device's (the host's may be bounds)
    extend = forward_batch.extend_seq_lens_cpu
    if window >= 0:  # a request reads at most window + its new tokens, and never past its (bounded) length
        spans = (min(s, window + e) for s, e in zip(forward_batch.seq_lens_cpu, extend, strict=True))
        start = (prefix - window).clamp_(min=0)  # [B, 1]: no query sees a key before it
    else:
        spans, start = iter(forward_batch.seq_lens_cpu), None
    max_keys = max(spans)
    columns = torch.arange(max_keys, device=device)
    rows = forward_batch.kv_pool.req_to_token.index_select(0, forward_batch.req_pool_indices)
    key_idx = columns.expand(batch, max_keys) if start is None else start + columns  # [B, L]
    last = forward_batch.seq_lens.unsqueeze(1) - 1
    key_valid = key_idx <= last
    # A padding column reads the request's last key again, never a slot of another request or outside the window:
    # whatever such a slot holds (NaN in a recycled page) would survive the mask as 0 * NaN.
    key_slots = rows.gather(1, torch.minimum(key_idx, last))
    query_idx = prefix + torch.arange(max_queries, device=device)  # [B, T]: each query's own key index
    if causal:
        visible = key_idx.unsqueeze(1) <= query_idx.unsqueeze(-1)  # [B, T, L]
    else:
        visible = key_valid.unsqueeze(1).expand(batch, max_queries, max_keys).clone()
    squares = _tree_squares(forward_batch, max_queries, device) if tree else None
    if squares is not None:  # each request's new-token columns: its block of the tree mask, placed on the device
        new = (key_idx - prefix).clamp(0, max_queries - 1)  # [B, L]: a key's index among the new tokens
        is_new = (key_idx >= prefix) & (key_idx - prefix < forward_batch.extend_seq_lens.unsqueeze(1))
        among_new = squares.gather(2, new.unsqueeze(1).expand(batch, max_queries, max_keys))
        visible = torch.where(is_new.unsqueeze(1), among_new, visible)
    if window >= 0:
        key_pos, query_pos = key_idx, query_idx
        if squares is not None:  # a new token's position is its prefix plus its depth in the tree
            depth = squares.sum(dim=2) - squares.diagonal(dim1=1, dim2=2).to(torch.int64)  # [B, T] ancestors
            query_pos = prefix + depth
            new = (key_idx - prefix).clamp(0, max_queries - 1)
            key_pos = torch.where(key_idx >= prefix, prefix + depth.gather(1, new), key_idx)
        visible &= query_pos.unsqueeze(-1) - key_pos.unsqueeze(1) <= window
    visible &= key_valid.unsqueeze(1)
    first = columns == 0  # column 0 is a real key of every request (each reads at least one)
    visible |= ~query_valid.unsqueeze(-1) & first  # padding queries keep a finite softmax; they are never returned
    blind = None
    if tree:  # only a tree row can see nothing: a causal or bidirectional query always sees itself
        seen = visible.any(dim=-1, keepdim=True)  # [B, T, 1], kept on the device: no read
        visible |= ~seen & first  # it reads key 0, so softmax never sees an all-masked row
        blind = ~seen.squeeze(-1)
    return _Keys(key_slots, ~visible, blind)


def _tree_squares(forward_batch: ForwardBatch, max_queries: int, device: torch.device) -> torch.Tensor:
    """``[B, T, T]`` bool: request ``b``'s ``new x new`` block of the tree mask in its top-left corner, padding
    False (the blocks' sizes are the exact host counts of new tokens: nothing is read)."""
    assert forward_batch.tree_mask is not None
    lens = forward_batch.extend_seq_lens_cpu
    blocks = forward_batch.tree_mask.split_with_sizes([new * new for new in lens])
    squares = torch.zeros((len(lens), max_queries, max_queries), dtype=torch.bool, device=device)
    for b, (new, block) in enumerate(zip(lens, blocks, strict=True)):
        squares[b, :new, :new] = block.view(new, new)
    return squares
