"""``batched_matmul``'s multi-head latent attention (docs/mla.md): both forms as padded, masked batched matmuls.

Both kernels reuse the padded layout and the causal key plan the backend makes once per batch (an MLA layer has
no attention variant), so an MLA layer plans nothing after the batch's first:

* The absorbed form has a single KV head whose keys are the whole latent row and whose values are the row's first
  ``kv_lora_rank`` columns. So the latent rows are gathered once per layer (``[B, L, latent]``), the values are a
  view of them, and every query head folds into the query axis: queries ``[B, T * heads, latent]`` meet the rows in
  one ``bmm``, the mask ``[B, T, 1, L]`` broadcasts over the heads, and a second ``bmm`` reads the values.
* The MHA form is plain causal attention over its own ``k``/``v`` arguments, with a V head dim of its own. It runs
  for batches without a cached prefix only, where every request's keys are its new tokens: the padded key axis is
  then the padded query axis, and the batch's mask is already this form's mask (causal, or the tree).

Queries move between token order and the padded layout through an index of the real rows that the plan computes
once, so a layer never pays a boolean-mask scatter (a device sync). Scores and softmax run in float32 for half
inputs, as in the dense path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnhost import AttentionLayer
    from attnhost_batched.plan import Metadata

__all__ = ["attend_latent", "attend_mha"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _padded(meta: Metadata, parts: tuple[torch.Tensor, ...], heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``parts`` (token order, ``[n, heads, d_i]`` each) side by side in the padded layout ``[B * T, heads, sum d]``,
    padding rows zero: split rope parts are joined here, in the one copy padding makes anyway."""
    batch, max_queries = meta.query_valid.shape
    widths = [part.shape[-1] for part in parts]
    padded = parts[0].new_zeros((batch * max_queries, heads, sum(widths)), dtype=dtype)
    start = 0
    for part, width in zip(parts, widths, strict=True):
        padded[..., start : start + width].index_copy_(0, meta.query_rows, part.to(dtype))
        start += width
    return padded


def attend_latent(
    meta: Metadata,
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    latent: torch.Tensor,
    layer: AttentionLayer,
    rank: int,
) -> torch.Tensor:
    """The absorbed form: ``q`` ``[n, heads, latent]`` (or ``[n, heads, rank]`` with ``q_rope`` the rest) over the
    latent rows ``[slots, 1, latent]`` of every request; returns ``[n, heads, rank]`` in ``q``'s dtype."""
    batch, max_queries = meta.query_valid.shape
    plan = meta.keys(layer)  # an MLA layer is plain causal attention: the batch's causal plan
    max_keys = plan.key_slots.shape[1]
    heads, width = layer.num_heads, latent.shape[-1]
    compute = _compute_dtype(q.dtype)
    parts = (q,) if q_rope is None else (q, q_rope)
    queries = _padded(meta, parts, heads, compute).view(batch, max_queries * heads, width)
    rows = latent.index_select(0, plan.key_slots.flatten()).view(batch, max_keys, width).to(compute)

    scores = torch.bmm(queries, rows.transpose(1, 2)).mul_(layer.scaling)  # [B, T * heads, L]
    scores = scores.view(batch, max_queries, heads, max_keys).masked_fill_(plan.blocked.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, max_queries * heads, max_keys)
    out = torch.bmm(probs, rows[..., :rank]).view(batch, max_queries, heads, rank)  # values: a view of the rows
    if plan.blind is not None:  # a query that sees no key gets zeros (it read key 0 only to keep softmax finite)
        out.masked_fill_(plan.blind.view(batch, max_queries, 1, 1), 0.0)
    return out.view(batch * max_queries, heads, rank).index_select(0, meta.query_rows).to(q.dtype)


def attend_mha(
    meta: Metadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer
) -> torch.Tensor:
    """The MHA form over a batch without cached prefixes: ``q``/``k`` ``[n, heads, qk_head_dim]``, ``v`` ``[n, heads,
    v_head_dim]``, each request attending causally (or by its tree) over its own rows; returns ``[n, heads,
    v_head_dim]`` in ``q``'s dtype."""
    batch, max_queries = meta.query_valid.shape
    plan = meta.keys(layer)  # an MLA layer is plain causal attention: the batch's causal plan
    heads, v_dim = layer.num_heads, layer.v_head_dim
    compute = _compute_dtype(q.dtype)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [n, heads, d] -> padded [B, heads, T, d]
        padded = _padded(meta, (x,), heads, compute)
        return padded.view(batch, max_queries, heads, -1).transpose(1, 2)

    queries, keys, values = heads_first(q), heads_first(k), heads_first(v)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(layer.scaling)  # [B, heads, T, T]
    scores.masked_fill_(plan.blocked.unsqueeze(1), float("-inf"))  # no prefix: the key axis is the query axis
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, heads, T, v_dim]
    if plan.blind is not None:
        out.masked_fill_(plan.blind.view(batch, 1, max_queries, 1), 0.0)
    out = out.transpose(1, 2).reshape(batch * max_queries, heads, v_dim)
    return out.index_select(0, meta.query_rows).to(q.dtype)
