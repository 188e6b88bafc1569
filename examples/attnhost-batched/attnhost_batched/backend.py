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

The plan (the padded layout, and each kind's keys and mask) is in
:mod:`attnhost_batched.plan`. It also serves MLA models (DeepSeek, Kimi;
docs/mla.md) on the same plan: the kernels of both MLA forms are in
:mod:`attnhost_batched.mla`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnhost import AttentionBackend, AttentionLayer, BackendCapabilities
from attnhost_batched.mla import attend_latent, attend_mha
from attnhost_batched.plan import Metadata

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost import AttentionRunner, ForwardBatch

__all__ = ["BatchedMatmulAttnBackend"]


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
        self._metadata: Metadata | None = None

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
        self._metadata = Metadata(forward_batch, query_valid, query_rows, prefixed, {})

    def _plan(self, forward_batch: ForwardBatch) -> Metadata:
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
