"""SGLang's ``torch_native`` backend: causal attention with PyTorch's SDPA over the KV cache.

Per-batch work (``init_forward_metadata``) decides, once, how each request's
keys are read and which mask it needs (the plan: plan.py); per-layer work is then the cache write
and SDPA calls: one per decode chunk, one per extend request.  Three measured
choices shape the code:

* The cache is token-major (``[slot, kv_head, dim]``).  An extending request
  whose slots form one ascending run is read through a zero-copy view; only
  fragmented requests pay for a gather, and on several threads a request
  gathered alone is gathered head-major (head_major.py), the way SDPA then
  splits it between threads.
* Decode batches are attended in chunks, not request by request: each
  chunk's key rows are gathered with one ``index_select`` (requests sorted
  by length and padded, the padding masked) and attended with one batched
  SDPA call.  A per-request loop pays a kernel launch, a thread-pool wake-up
  and a poorly parallel SDPA (one request has only ``kv_heads`` units of
  work) for every request of every layer; on fragmented slots that, not the
  gather, dominated (BENCHMARKS.md, "SGLang bridge").
* For GQA/MQA the ``group`` query heads that share a KV head are folded into
  the query-length axis (``[kv_heads, group * tokens, dim]``), so SDPA sees a
  plain multi-head problem.  On CPU ``enable_gqa=True`` falls back to a slow
  path for few queries, which folding avoids for decode and short extends
  (BENCHMARKS.md, "What makes it fast").  The one exception is a long
  prefill without prefix: there ``is_causal=True`` avoids materialising a
  ``group * tokens * tokens`` mask at the same speed.

A speculative tree (``ForwardBatch.tree_mask``) changes only which mask a
request gets: its prefix columns all visible, then its own block of the tree
mask. It is built once per batch with the causal masks, so a tree verify costs
per layer what a chain verify of the same size costs (BENCHMARKS.md, "Speculative verify"). A tree
row that is all False in a request without a prefix leaves its query no key;
the contract gives it zeros, which SDPA does not promise for a row that may
attend nowhere (older releases gave NaN), so the plan finds those rows once
and the layers zero them.

Layers with an attention variant (docs/variants.md: a sliding window, a
soft-cap, sinks, non-causal) are planned the same way, once per batch, in
``torch_native_variants.py``; decode keeps its chunks, each request's row
cut to the window. Plain layers take exactly the path above.

It declares no graph support (``BackendCapabilities.cuda_graph``), as SGLang
switches graphs off for its own ``torch_native``: every choice above (a view
or a gather, which requests share a decode chunk, the masks' sizes) is made
from the requests' slots and exact lengths read on the host, once per batch.
That is what makes it fast eagerly, and what a captured step cannot do
(docs/graphs.md); the engines run it without graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnhost.backend import FLOAT_DTYPES, FP8_KV_DTYPES, AttentionBackend, AttentionLayer, BackendCapabilities
from attnhost_builtin import torch_native_mla, torch_native_variants
from attnhost_builtin.head_major import gather_head_major, head_rows
from attnhost_builtin.plan import BatchPlan, Limits, RequestPlan, plan_request, plan_trees
from attnhost_builtin.shapes import check_rows

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost.backend import AttentionRunner
    from attnhost.forward_batch import ForwardBatch

__all__ = ["TorchNativeAttnBackend"]

# The measured thresholds: the plan (plan.py) applies them, handed over with each batch as a plan.Limits.
# Above this many query rows a prefix-free request uses is_causal + enable_gqa
# instead of a folded, masked call (same speed, no mask memory).
_CAUSAL_MIN_TOKENS = 256
# Largest folded mask (elements) worth materialising; beyond it the unfolded
# [tokens, seq] mask with enable_gqa costs the same compute and less memory.
_MAX_FOLDED_MASK = 1 << 25
# Bytes of K and V one decode chunk gathers: small enough that the gathered rows are still in cache when
# SDPA reads them, large enough that a chunk holds several requests of a small model (BENCHMARKS.md,
# "What makes it fast"). A request larger than this is a chunk alone.
_DECODE_CHUNK_BYTES = 8 << 20


class TorchNativeAttnBackend(AttentionBackend):
    """Reference-quality attention on any device torch runs on; SGLang's ``torch_native``."""

    # Every path views q itself anyway, so SGLang's [T, heads * dim] layout costs nothing extra.
    # An FP8 cache is dequantised where its rows change dtype anyway; pages are read through req_to_token.
    capabilities = BackendCapabilities(
        kv_cache_dtypes=(*FLOAT_DTYPES, *FP8_KV_DTYPES),
        flat_heads=True,
        tree_mask=True,
        mla=True,
        sliding_window=True,
        logit_cap=True,
        sinks=True,
        non_causal=True,
    )

    def __init__(self, runner: AttentionRunner | None = None) -> None:
        super().__init__(runner)
        self._plan: BatchPlan | None = None
        self._mha_checked: ForwardBatch | None = None  # the last batch the MLA MHA form accepted

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Resolve every request's key slots once, so layers only slice and call SDPA."""
        table = forward_batch.kv_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        limits = Limits(_CAUSAL_MIN_TOKENS, _MAX_FOLDED_MASK, _DECODE_CHUNK_BYTES)
        plans, largest = [], (-1, -1, -1, -1)
        for i, (row, q_start, prefix, extend) in enumerate(
            zip(
                rows,
                forward_batch.extend_start_loc_cpu,
                forward_batch.prefix_lens_cpu,
                forward_batch.extend_seq_lens_cpu,
                strict=True,
            )
        ):
            plan, (high, position) = plan_request(table[row], q_start, prefix, extend, (i, row), limits)
            plans.append(plan)
            if high > largest[0]:
                largest = (high, i, row, position)
        if forward_batch.tree_mask is not None:
            plan_trees(plans, forward_batch.tree_mask)
        lone_view = len(plans) == 1 and plans[0].kv_run is not None  # nothing to gather: a view is cheaper
        if plans and not lone_view and all(plan.q_len == 1 and plan.tree is None for plan in plans):
            self._plan = BatchPlan(forward_batch, plans, limits, (table, rows), largest=largest)
        else:
            longest = max((plan.seq_len for plan in plans if plan.kv_run is None), default=0)
            self._plan = BatchPlan(forward_batch, plans, limits, None, longest, largest=largest)

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
        plan = self._plan_for(forward_batch)
        pool = forward_batch.kv_pool
        tokens, lid = forward_batch.num_new_tokens, layer.layer_id
        check_rows("q", q, tokens, layer.num_heads, layer.head_dim, lid)
        if save_kv_cache:
            check_rows("k", k, tokens, layer.num_kv_heads, layer.head_dim, lid)
            check_rows("v", v, tokens, layer.num_kv_heads, layer.head_dim, lid)
        plan.check_reads(min(pool.k_buffer(lid).shape[0], pool.v_buffer(lid).shape[0]), lid)
        if save_kv_cache:
            if k.dim() != 3:  # accepted flat, as SGLang's own backends accept them
                k, v = (t.view(-1, layer.num_kv_heads, layer.head_dim) for t in (k, v))
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        flat = q.dim() == 2  # [T, heads * dim] in, the same out (capabilities.flat_heads)
        k_buffer, v_buffer = pool.k_buffer(layer.layer_id), pool.v_buffer(layer.layer_id)
        if layer.has_sinks or sinks is not None:
            torch_native_variants.check_sinks(layer, sinks)
        if plan.decode_table is not None:
            return _decode(q, k_buffer, v_buffer, plan, layer, flat, sinks)
        if flat:
            q = q.view(-1, layer.num_heads, layer.head_dim)
        if layer.sliding_window_size >= 0 or not layer.is_causal or layer.logit_cap > 0.0 or sinks is not None:
            out = torch_native_variants.attend(plan, q, k_buffer, v_buffer, layer, sinks)
            return out.view(-1, layer.num_heads * layer.head_dim) if flat else out
        gathers = plan.longest_gather and plan.head_major
        k_rows, v_rows = (head_rows(k_buffer), head_rows(v_buffer)) if gathers else (None, None)
        if len(plan.requests) == 1:
            # SDPA's CPU flash kernel already lays its output out token-major,
            # so a lone request needs no copy into an output buffer.
            req = plan.requests[0]
            keys, values = req.keys(k_buffer, k_rows, None), req.keys(v_buffer, v_rows, None)
            out = _attend_request(q, keys, values, layer, req)
            return out.reshape(-1, layer.num_heads * layer.head_dim) if flat else out.contiguous()
        k_scratch, v_scratch = plan.gather_scratch(k_buffer, 0), plan.gather_scratch(v_buffer, 1)
        # Requests are laid out in order in q, so their outputs are concatenated once at the
        # end (one kernel) rather than copied into an output tensor one by one. SDPA's
        # outputs are fresh tensors, so reusing the gather scratch for the next request is safe.
        out = torch.cat(
            [
                _attend_request(
                    q[req.q_start : req.q_start + req.q_len],
                    req.keys(k_buffer, k_rows, k_scratch),
                    req.keys(v_buffer, v_rows, v_scratch),
                    layer,
                    req,
                )
                for req in plan.requests
            ]
        )
        return out.view(-1, layer.num_heads * layer.head_dim) if flat else out

    def forward_mla_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        """MLA's MHA form (torch_native_mla.py); its batch is checked on the first layer only."""
        plan = self._plan_for(forward_batch)
        if self._mha_checked is not forward_batch:
            torch_native_mla.check_mha_batch(forward_batch)
            self._mha_checked = forward_batch
        return torch_native_mla.forward_mha(plan, q, k, v, layer)

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
        """MLA's absorbed form, every forward mode (torch_native_mla.py)."""
        plan = self._plan_for(forward_batch)
        plan.check_reads(forward_batch.kv_pool.k_buffer(layer.layer_id).shape[0], layer.layer_id)
        return torch_native_mla.forward_mqa(plan, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def _plan_for(self, forward_batch: ForwardBatch) -> BatchPlan:
        plan = self._plan
        if plan is None or plan.batch is not forward_batch:
            raise RuntimeError(
                "TorchNativeAttnBackend: init_forward_metadata() was not called for this "
                "ForwardBatch; call it once per batch before the layers run"
            )
        return plan


def _decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: BatchPlan,
    layer: AttentionLayer,
    flat: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: one query per request and every key visible, so a chunk is one gather and one SDPA call.

    The queries are viewed GQA-folded (``[requests, kv_heads, q_per_kv,
    dim]``, q's own memory order, from either of its layouts), so SDPA sees
    a plain multi-head problem whose batch is the chunk's requests. A window
    only shortens each request's gathered row (``BatchPlan.decode_chunks``); one query
    sees its request's every key whether the layer is causal or not; a
    soft-cap or sinks take the explicit softmax instead of SDPA.
    """
    kv_heads, dim = layer.num_kv_heads, layer.head_dim
    shape = (-1, layer.num_heads * dim) if flat else (-1, layer.num_heads, dim)
    queries = q.view(-1, kv_heads, layer.num_heads // kv_heads, dim)
    k_rows, v_rows = (head_rows(k_buffer), head_rows(v_buffer)) if plan.head_major else (None, None)
    chunks, most = plan.decode_chunks(k_buffer, k_rows is not None and v_rows is not None, layer.sliding_window_size)
    k_scratch, v_scratch = plan.gather_scratch(k_buffer, 0, most), plan.gather_scratch(v_buffer, 1, most)
    assert k_scratch is not None and v_scratch is not None
    convert = k_buffer.dtype != q.dtype
    explicit = layer.logit_cap > 0.0 or sinks is not None
    sink_rows = None if sinks is None else torch_native_variants.sink_rows(sinks, kv_heads, 1, q.dtype)
    out = None if len(chunks) == 1 and isinstance(chunks[0].rows, slice) else torch.empty_like(queries)
    for chunk in chunks:
        count, width = chunk.count, chunk.width
        k_out, v_out = k_scratch[: count * width], v_scratch[: count * width]
        if chunk.head_major:
            assert k_rows is not None and v_rows is not None
            keys = gather_head_major(k_rows, chunk.index, k_out, kv_heads, width)
            values = gather_head_major(v_rows, chunk.index, v_out, kv_heads, width)
        else:
            keys = torch.index_select(k_buffer, 0, chunk.index, out=k_out)
            values = torch.index_select(v_buffer, 0, chunk.index, out=v_out)
            keys = keys.view(count, width, kv_heads, dim).transpose(1, 2)
            values = values.view(count, width, kv_heads, dim).transpose(1, 2)
        if convert:
            keys = torch_native_variants.kv_as(keys, q.dtype, layer.k_scale)
            values = torch_native_variants.kv_as(values, q.dtype, layer.v_scale)
        mine = queries[chunk.rows] if isinstance(chunk.rows, slice) else queries.index_select(0, chunk.rows)
        if explicit:
            work = torch_native_variants.work_dtype(q.dtype)
            o = torch_native_variants.explicit_attention(
                mine, keys, values, chunk.mask(work), layer.scaling, layer.logit_cap, sink_rows
            )
        else:
            o = F.scaled_dot_product_attention(mine, keys, values, attn_mask=chunk.mask(q.dtype), scale=layer.scaling)
        if out is None:
            return o.view(shape)
        if isinstance(chunk.rows, slice):
            out[chunk.rows] = o
        else:
            out.index_copy_(0, chunk.rows, o)
    assert out is not None
    return out.view(shape)


def _attend_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    req: RequestPlan,
) -> torch.Tensor:
    """SDPA for one request: ``q`` ``[tokens, heads, dim]``, ``k``/``v`` ``[seq, kv_heads, dim]``; a token that
    sees no key (``req.blind``) gets zeros.

    Inputs are given SDPA as 4-D ``[1, heads, len, dim]`` views: on CPU only
    4-D inputs reach the fused flash kernel; 3-D ones take the slower math
    path.
    """
    out = _sdpa_request(q, k, v, layer, req)
    return out if req.blind is None else out.masked_fill(req.blind, 0.0)


def _sdpa_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    req: RequestPlan,
) -> torch.Tensor:
    """:func:`_attend_request`'s SDPA call, in the layout that is fastest for the request."""
    group = layer.num_heads // layer.num_kv_heads
    k_h, v_h = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # views
    if k_h.dtype != q.dtype:
        k_h, v_h = (
            torch_native_variants.kv_as(k_h, q.dtype, layer.k_scale),
            torch_native_variants.kv_as(v_h, q.dtype, layer.v_scale),
        )
    folds, is_causal, mask = req.recipe(group, q.device)
    if folds and req.q_len == 1:
        # One query token (decode): the folded [kv_heads, group, dim] layout is q's own memory
        # order (head = kv_head * group + g), so a view replaces the transpose-and-copy below.
        o = F.scaled_dot_product_attention(
            q.reshape(1, layer.num_kv_heads, group, layer.head_dim), k_h, v_h, attn_mask=mask, scale=layer.scaling
        )
        return o.reshape(1, layer.num_heads, layer.head_dim)
    q_h = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim]
    if folds:
        folded = q_h.reshape(1, layer.num_kv_heads, group * req.q_len, layer.head_dim)
        o = F.scaled_dot_product_attention(folded, k_h, v_h, attn_mask=mask, scale=layer.scaling)
        return o.reshape(layer.num_heads, req.q_len, layer.head_dim).transpose(0, 1)
    o = F.scaled_dot_product_attention(
        q_h,
        k_h,
        v_h,
        attn_mask=mask,
        is_causal=is_causal,
        scale=layer.scaling,
        enable_gqa=group > 1,
    )
    return o[0].transpose(0, 1)
