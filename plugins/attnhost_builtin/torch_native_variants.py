"""``torch_native``'s attention variants (docs/variants.md): sliding windows, soft-caps, sinks, non-causal layers.

Plain causal layers never come here: their path (torch_native.py) is unchanged. A layer with a variant is planned
the way plain ones are, once per batch and request, on its first layer, and reused by every layer with the same
window, causality and head layout (``RequestPlan.variants``, plan.py):

* **Which keys.** A request's queries are cut into blocks; each block reads only the key rows its queries may
  see (with a window, from the first query's position minus the window on), so a windowed layer reads the
  window and not the whole cache. Its mask follows from three numbers (rows, columns, the first query's position
  minus the first key's) and the layer's window and causality, so the blocks of a long prompt, whose masks are
  the same band, share one tensor (``BatchPlan.variant_masks``). A block that sees all its keys has no mask.
  Blocks are small enough that a block's scores stay within ``_BLOCK_ELEMENTS``: a long windowed prompt never
  materialises a ``tokens x tokens`` mask. A speculative tree is one block whose mask is built from the tree's
  positions (prefix plus depth); a query it leaves no key gets zeros.
* **Which softmax.** SDPA has neither a tanh cap nor a sink, so a layer with either takes an explicit
  matmul-softmax in float32 (``explicit_attention``); the others keep SDPA with the block's mask.
* **Decode** keeps its chunked gather (torch_native.py), each request's row cut to its last ``window + 1``
  slots: the gather and the attention then cost the window, not the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnhost_builtin.plan import BatchPlan, Block, Recipe, RequestPlan

if TYPE_CHECKING:
    from attnhost.backend import AttentionLayer

__all__ = ["Recipe", "attend", "check_sinks", "explicit_attention", "kv_as", "sink_rows", "work_dtype"]

# Largest score matrix (query heads x query rows x key rows) one block computes: a long prompt is cut into
# blocks of queries below it, so the explicit path's float32 scores and a folded mask stay tens of MB.
_BLOCK_ELEMENTS = 1 << 24


def kv_as(rows: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache rows as ``dtype`` values: an FP8 row (one byte) is ``stored.to(float32) * scale`` (docs/kv-cache.md),
    a float row is cast, its scale ignored as the engines ignore it. Called only where rows change dtype, so a
    float cache read in its own dtype pays nothing."""
    if scale == 1.0 or rows.element_size() != 1:
        return rows.to(dtype)  # FP8 values are exact in every float dtype: no float32 step needed
    return rows.to(torch.float32).mul_(scale).to(dtype)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The explicit softmax's dtype: float32 for half types, whose scores would lose the cap's and sinks' effect."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def check_sinks(layer: AttentionLayer, sinks: torch.Tensor | None) -> None:
    """Refuse sinks a layer does not declare, a sink layer called without them, or a tensor of the wrong shape."""
    if sinks is None:
        raise ValueError(
            f"torch_native: layer {layer.layer_id} has attention sinks (has_sinks=True) but was called without "
            "them; pass its [num_heads] sink logits as forward(..., sinks=...)"
        )
    if not layer.has_sinks:
        raise ValueError(
            f"torch_native: layer {layer.layer_id} was called with sinks= but does not declare has_sinks=True; "
            "build the layer with has_sinks=True or call it without sinks"
        )
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(
            f"torch_native: layer {layer.layer_id}'s sinks are a {type(sinks).__name__}, not a torch.Tensor; pass "
            f"its [{layer.num_heads}] sink logits as a tensor (torch.tensor(...))"
        )
    if sinks.dim() != 1 or sinks.shape[0] != layer.num_heads:
        raise ValueError(
            f"torch_native: layer {layer.layer_id}'s sinks have shape {tuple(sinks.shape)}, expected "
            f"({layer.num_heads},): one logit per query head of this rank"
        )


def sink_rows(sinks: torch.Tensor, kv_heads: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``sinks`` laid out as the GQA-folded queries' rows (``[1, kv_heads, group * rows, 1]``, group-major)."""
    group = sinks.shape[0] // kv_heads
    folded = sinks.to(work_dtype(dtype)).view(kv_heads, group, 1).expand(kv_heads, group, rows)
    return folded.reshape(1, kv_heads, group * rows, 1)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention written out, for what SDPA cannot do: ``cap * tanh(s / cap)`` scores and sinks in the
    denominator. ``mask`` is additive (0 or -inf) in :func:`work_dtype`; ``sinks`` broadcasts as the scores' rows
    (:func:`sink_rows`). A row that sees no key gets zeros with sinks, NaN without (the caller zeroes it)."""
    work = work_dtype(q.dtype)
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)).mul_(scale)
    if cap > 0.0:
        scores.div_(cap).tanh_().mul_(cap)
    if mask is not None:
        scores.add_(mask)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
        weights = scores.sub_(peak).exp_()
        weights.div_(weights.sum(dim=-1, keepdim=True).add_(torch.exp(sinks - peak)))
    return torch.matmul(weights, v.to(work)).to(q.dtype)


def attend(
    plan: BatchPlan,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layer: AttentionLayer,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A variant layer over an extend-shaped batch: ``q`` ``[tokens, heads, dim]`` in, the same out."""
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    group = heads // kv_heads
    key = (layer.sliding_window_size, layer.is_causal, heads, group)
    explicit = layer.logit_cap > 0.0 or sinks is not None
    work = work_dtype(q.dtype) if explicit else q.dtype
    outputs = []
    for req in plan.requests:
        recipe = req.variants.get(key)
        if recipe is None:
            recipe = req.variants[key] = _recipe(plan, req, layer)
        k_h = _key_rows(plan, req, k_buffer, recipe.first_key, 0).transpose(0, 1).unsqueeze(0)
        v_h = _key_rows(plan, req, v_buffer, recipe.first_key, 1).transpose(0, 1).unsqueeze(0)
        if k_h.dtype != work:
            k_h, v_h = kv_as(k_h, work, layer.k_scale), kv_as(v_h, work, layer.v_scale)
        queries = q[req.q_start : req.q_start + req.q_len]
        parts = []
        for block in recipe.blocks:
            rows = block.rows.stop - block.rows.start
            folded = queries[block.rows].transpose(0, 1).reshape(1, kv_heads, group * rows, dim)
            keys, values = k_h[:, :, block.keys], v_h[:, :, block.keys]
            if explicit:
                mask = None if block.mask_key is None else _additive(plan, block.mask_key, work)
                sink = None if sinks is None else sink_rows(sinks, kv_heads, rows, q.dtype)
                o = explicit_attention(folded, keys, values, mask, layer.scaling, layer.logit_cap, sink)
            else:
                mask = None if block.mask_key is None else plan.variant_masks[block.mask_key]
                o = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=layer.scaling)
            parts.append(o.reshape(heads, rows, dim).transpose(0, 1))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        outputs.append(out if recipe.blind is None else out.masked_fill(recipe.blind, 0.0))
    return outputs[0].contiguous() if len(outputs) == 1 else torch.cat(outputs)


def _key_rows(plan: BatchPlan, req: RequestPlan, buffer: torch.Tensor, first: int, role: int) -> torch.Tensor:
    """The request's cache rows from key ``first`` on: a view of a contiguous run, else a gather into scratch."""
    if req.kv_run is not None:
        return buffer[req.kv_run[0] + first : req.kv_run[1]]
    assert req.kv_index is not None
    count = req.seq_len - first
    scratch = plan.gather_scratch(buffer, role, count)
    return torch.index_select(buffer, 0, req.kv_index[first:], out=None if scratch is None else scratch[:count])


def _additive(plan: BatchPlan, mask_key: tuple[object, ...], dtype: torch.dtype) -> torch.Tensor:
    """A block's mask as 0 / -inf in ``dtype``, for the explicit softmax; built once per batch."""
    cache_key = (*mask_key, dtype)
    additive = plan.variant_masks.get(cache_key)
    if additive is None:
        visible = plan.variant_masks[mask_key]
        additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
        plan.variant_masks[cache_key] = additive
    return additive


def _recipe(plan: BatchPlan, req: RequestPlan, layer: AttentionLayer) -> Recipe:
    if req.tree is not None:
        return _tree_recipe(plan, req, layer)
    window, causal = layer.sliding_window_size, layer.is_causal
    prefix, q_len, seq_len = req.prefix_len, req.q_len, req.seq_len
    group = layer.num_heads // layer.num_kv_heads

    def key_range(first_query: int, end_query: int) -> tuple[int, int]:
        first = max(0, prefix + first_query - window) if window >= 0 else 0
        return first, (prefix + end_query if causal else seq_len)

    def widest(rows: int) -> int:  # the most keys a block of `rows` queries reads
        if window < 0:
            return seq_len
        return min(seq_len, rows + window) if causal else seq_len - max(0, prefix - window)

    rows = q_len
    while rows > 1 and layer.num_heads * rows * widest(rows) > _BLOCK_ELEMENTS:
        rows = (rows + 1) // 2
    first_key = key_range(0, rows)[0]
    blocks = []
    for start in range(0, q_len, rows):
        end = min(q_len, start + rows)
        lo, hi = key_range(start, end)
        offset = prefix + start - lo  # the block's first query position minus its first key position
        mask_key = _band(plan, end - start, hi - lo, offset, window, causal, group, req)
        blocks.append(Block(slice(start, end), slice(lo - first_key, hi - first_key), mask_key))
    return Recipe(first_key, blocks, None)


def _band(
    plan: BatchPlan,
    rows: int,
    cols: int,
    offset: int,
    window: int,
    causal: bool,
    group: int,
    req: RequestPlan,
) -> tuple[object, ...] | None:
    """The key of a non-tree block's mask in ``plan.variant_masks`` (built on first use), or None if its every
    query sees every key."""
    sees_all = (not causal or offset >= cols - 1) and (window < 0 or offset + rows - 1 <= window)
    if sees_all:
        return None
    key: tuple[object, ...] = ("band", rows, cols, offset, window, causal, group)
    if key not in plan.variant_masks:
        device = plan.batch.kv_pool.req_to_token.device
        distance = offset + torch.arange(rows, device=device).unsqueeze(1) - torch.arange(cols, device=device)
        visible = torch.ones((rows, cols), dtype=torch.bool, device=device)
        if causal:
            visible &= distance >= 0
        if window >= 0:
            visible &= distance <= window
        plan.variant_masks[key] = visible.repeat(group, 1) if group > 1 else visible
    return key


def _tree_recipe(plan: BatchPlan, req: RequestPlan, layer: AttentionLayer) -> Recipe:
    """One block over a speculative tree: the prefix and the tree, each key within the window of positions (a new
    token's position is the prefix plus its depth)."""
    if not layer.is_causal:
        raise ValueError(
            f"torch_native: layer {layer.layer_id} is non-causal (is_causal=False), and this "
            f"{plan.batch.forward_mode.name} batch carries a speculative tree (tree_mask), which has no meaning for a "
            "non-causal layer; verify with chains (speculative topk 1) for models with non-causal layers"
        )
    assert req.tree is not None
    window, prefix = layer.sliding_window_size, req.prefix_len
    tree = req.tree
    first_key = max(0, prefix - window) if window >= 0 else 0
    visible = torch.cat([tree.new_ones((req.q_len, prefix - first_key)), tree], dim=1)
    if window >= 0:
        depth = tree.sum(dim=1) - tree.diagonal().to(torch.int64)
        positions = torch.cat([torch.arange(first_key, prefix, device=tree.device), prefix + depth])
        visible = visible & ((prefix + depth).unsqueeze(1) - positions.unsqueeze(0) <= window)
    nothing = ~visible.any(dim=1)
    blind = nothing.view(-1, 1, 1) if bool(nothing.any()) else None
    group = layer.num_heads // layer.num_kv_heads
    key: tuple[object, ...] = ("tree", req.q_start, window, group)
    plan.variant_masks[key] = visible.repeat(group, 1) if group > 1 else visible
    cols = req.seq_len - first_key
    return Recipe(first_key, [Block(slice(0, req.q_len), slice(0, cols), key)], blind)
