"""``torch_native``'s multi-head latent attention (docs/mla.md): both forms on the batch plan the dense path makes.

It reuses what ``init_forward_metadata`` already decided per request (a view or a gather of its slots, its causal
or tree mask, the decode chunks), so an MLA batch costs no planning of its own. What is particular to MLA:

* The absorbed form has one KV head whose row is the latent, so a request gathers each key row once and reads
  its values as the first ``kv_lora_rank`` columns of the same gathered rows: half the bytes a separate V gather
  would move, which is what decode is bound by.
* Every query head shares that one KV head, so the heads fold into the query axis as the dense GQA path folds
  them (``RequestPlan.recipe`` with a group of ``num_heads``).
* The MHA form attends over its ``k``/``v`` arguments, not the cache, so it serves requests without a cached
  prefix only; a prefix is refused once per batch, on its first layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnhost_builtin.shapes import check_rows

if TYPE_CHECKING:
    from attnhost.backend import AttentionLayer
    from attnhost.forward_batch import ForwardBatch
    from attnhost.mla import MLAConfig
    from attnhost_builtin.plan import BatchPlan, RequestPlan

__all__ = ["check_mha_batch", "forward_mha", "forward_mqa"]


def _facts(layer: AttentionLayer) -> MLAConfig:
    mla = layer.mla
    if mla is None:
        raise ValueError(f"layer {layer.layer_id} is not an MLA layer; build it with AttentionLayer.for_mla()")
    return mla


def check_mha_batch(batch: ForwardBatch) -> None:
    """Refuse a batch the MHA form cannot attend: a request with a cached prefix (its keys are in the cache only
    as latent rows, which this form does not read)."""
    for i, prefix in enumerate(batch.prefix_lens_cpu):
        if prefix:
            raise ValueError(
                f"torch_native: MLA's MHA form attends over its k/v arguments only, but request {i} of this "
                f"{batch.forward_mode.name} batch has a cached prefix of {prefix} tokens; call the absorbed form "
                "(an MLAForm.ABSORBED layer) for requests with a prefix"
            )


def forward_mha(
    plan: BatchPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
) -> torch.Tensor:
    """The MHA form: per request, causal (or tree) attention over its own rows of ``k``/``v``."""
    heads, qk_dim, v_dim = layer.num_heads, layer.head_dim, layer.v_head_dim
    tokens = plan.batch.num_new_tokens
    for name, tensor, dim in (("q", q, qk_dim), ("k", k, qk_dim), ("v", v, v_dim)):
        check_rows(name, tensor, tokens, heads, dim, layer.layer_id)
    flat = q.dim() == 2
    q, k, v = q.view(-1, heads, qk_dim), k.view(-1, heads, qk_dim), v.view(-1, heads, v_dim)
    outputs = []
    for req in plan.requests:
        rows = slice(req.q_start, req.q_start + req.q_len)
        q_h, k_h, v_h = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if k_h.dtype != q.dtype:
            k_h, v_h = k_h.to(q.dtype), v_h.to(q.dtype)
        _, is_causal, mask = req.recipe(1, q.device)
        o = F.scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=mask, is_causal=is_causal, scale=layer.scaling)
        outputs.append(o[0].transpose(0, 1))
    out = outputs[0].contiguous() if len(outputs) == 1 else torch.cat(outputs)
    return out.view(-1, heads * v_dim) if flat else out


def forward_mqa(
    plan: BatchPlan,
    q: torch.Tensor,
    k: torch.Tensor | None,
    layer: AttentionLayer,
    forward_batch: ForwardBatch,
    save_kv_cache: bool,
    q_rope: torch.Tensor | None,
    k_rope: torch.Tensor | None,
) -> torch.Tensor:
    """The absorbed form: write the new latent rows when asked, then attend over every request's cached rows."""
    mla = _facts(layer)
    rank, width, heads = mla.kv_lora_rank, mla.latent_dim, layer.num_heads
    pool = forward_batch.kv_pool
    tokens, lid = forward_batch.num_new_tokens, layer.layer_id
    check_rows("q", q, tokens, heads, width if q_rope is None else rank, lid)
    if q_rope is not None:
        check_rows("q_rope", q_rope, tokens, heads, width - rank, lid)
    if save_kv_cache and k is not None:
        check_rows("k", k, tokens, 1, width if k_rope is None else rank, lid)
        if k_rope is not None:
            check_rows("k_rope", k_rope, tokens, 1, width - rank, lid)
    if save_kv_cache:
        if k is None:
            raise ValueError(
                f"torch_native: save_kv_cache=True but no k (the new latent rows) for MLA layer {layer.layer_id}"
            )
        row = k if k_rope is None else torch.cat([k.reshape(-1, 1, rank), k_rope.reshape(-1, 1, width - rank)], -1)
        row = row.reshape(-1, 1, width)
        pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, row, row[..., :rank])
    flat = q.dim() == 2
    if q_rope is not None:  # the model computed the two parts apart; SDPA takes one query
        q = torch.cat([q.reshape(-1, heads, rank), q_rope.reshape(-1, heads, width - rank)], -1)
    else:
        q = q.view(-1, heads, width)
    latent = pool.k_buffer(layer.layer_id)
    if plan.decode_table is not None:
        out = _decode(q, latent, plan, layer, rank)
    else:
        scratch = plan.gather_scratch(latent, 0)
        parts = [
            _attend_request(q[req.q_start : req.q_start + req.q_len], req.keys(latent, None, scratch), layer, req, rank)
            for req in plan.requests
        ]
        out = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
    return out.reshape(-1, heads * rank) if flat else out


def _attend_request(
    q: torch.Tensor, rows: torch.Tensor, layer: AttentionLayer, req: RequestPlan, rank: int
) -> torch.Tensor:
    """One request: ``q`` ``[tokens, heads, latent]`` over its latent ``rows`` ``[seq, 1, latent]``, the values
    being the rows' first ``rank`` columns; returns ``[tokens, heads, rank]``."""
    heads, width = layer.num_heads, layer.head_dim
    k_h = rows.transpose(0, 1).unsqueeze(0)  # [1, 1, seq, latent], a view
    if k_h.dtype != q.dtype:
        k_h = k_h.to(q.dtype)
    v_h = k_h[..., :rank]
    folds, is_causal, mask = req.recipe(heads, q.device)
    if folds and req.q_len == 1:  # [1, heads, latent] is already the folded order
        o = F.scaled_dot_product_attention(q.reshape(1, 1, heads, width), k_h, v_h, attn_mask=mask, scale=layer.scaling)
        return o.reshape(1, heads, rank)
    q_h = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, latent]
    if folds:
        folded = q_h.reshape(1, 1, heads * req.q_len, width)
        o = F.scaled_dot_product_attention(folded, k_h, v_h, attn_mask=mask, scale=layer.scaling)
        return o.reshape(heads, req.q_len, rank).transpose(0, 1)
    o = F.scaled_dot_product_attention(
        q_h, k_h, v_h, attn_mask=mask, is_causal=is_causal, scale=layer.scaling, enable_gqa=heads > 1
    )
    return o[0].transpose(0, 1)


def _decode(q: torch.Tensor, latent: torch.Tensor, plan: BatchPlan, layer: AttentionLayer, rank: int) -> torch.Tensor:
    """Decode in the dense path's chunks: one gather of latent rows per chunk, its values a view of them."""
    heads, width = layer.num_heads, layer.head_dim
    queries = q.view(-1, 1, heads, width)  # [requests, 1 KV head, heads, latent]: q's own memory order
    chunks, most = plan.decode_chunks(latent, False)
    scratch = plan.gather_scratch(latent, 0, most)
    assert scratch is not None
    out = (
        None if len(chunks) == 1 and isinstance(chunks[0].rows, slice) else q.new_empty((len(queries), 1, heads, rank))
    )
    for chunk in chunks:
        count, seq = chunk.count, chunk.width
        keys = torch.index_select(latent, 0, chunk.index, out=scratch[: count * seq])
        keys = keys.view(count, seq, 1, width).transpose(1, 2)
        if keys.dtype != q.dtype:
            keys = keys.to(q.dtype)
        mine = queries[chunk.rows] if isinstance(chunk.rows, slice) else queries.index_select(0, chunk.rows)
        o = F.scaled_dot_product_attention(
            mine, keys, keys[..., :rank], attn_mask=chunk.mask(q.dtype), scale=layer.scaling
        )
        if out is None:
            return o.view(-1, heads, rank)
        if isinstance(chunk.rows, slice):
            out[chunk.rows] = o
        else:
            out.index_copy_(0, chunk.rows, o)
    assert out is not None
    return out.view(-1, heads, rank)
