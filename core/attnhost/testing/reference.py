"""The trusted attention every backend is compared against.

Deliberately naive: float64, an explicit loop over requests, each KV head
read by its group of query heads, the causal (or speculative tree) mask written out with
the layer's window from positions, the soft-cap and the sinks applied by
their definitions (docs/variants.md), softmax by definition.  It
shares no code path with any backend (no SDPA), so agreement means something.
It reads keys and values from the KV cache, exactly as a backend must, so the
cache has to hold the new tokens' K/V before it is called.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnhost.backend import AttentionLayer
from attnhost.forward_batch import ForwardBatch

__all__ = [
    "cache_values",
    "causal_mask",
    "reference_attention",
    "reference_request_attention",
    "tree_blocks",
    "tree_mask",
]


def cache_values(buffer: torch.Tensor, scale: float) -> torch.Tensor:
    """What a cache buffer holds as values: an FP8 one's ``stored * scale`` in float64 (docs/kv-cache.md), a
    float one as it is (its scale ignored, as the engines ignore it)."""
    if buffer.element_size() != 1:
        return buffer
    return buffer.to(torch.float64) * scale


def reference_attention(
    q: torch.Tensor,
    layer: AttentionLayer,
    forward_batch: ForwardBatch,
    *,
    k_buffer: torch.Tensor | None = None,
    v_buffer: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``[num_new_tokens, num_heads, head_dim]`` in float64, with the layer's variants
    (``sinks``: the ``[num_heads]`` logits a layer with ``has_sinks`` is called with).

    ``q`` holds the batch's new tokens in request order.  Keys and values come
    from ``forward_batch.kv_pool`` for ``layer.layer_id`` unless ``k_buffer`` /
    ``v_buffer`` (``[num_slots, num_kv_heads, head_dim]``) are given, e.g. a
    snapshot taken before a backend could have touched the cache. An FP8 cache is
    read dequantised with the layer's scales (:func:`cache_values`).
    """
    pool = forward_batch.kv_pool
    k_buf = cache_values(pool.k_buffer(layer.layer_id) if k_buffer is None else k_buffer, layer.k_scale)
    v_buf = cache_values(pool.v_buffer(layer.layer_id) if v_buffer is None else v_buffer, layer.v_scale)
    q = q.reshape(-1, layer.num_heads, layer.head_dim)
    outputs = [torch.zeros((0, layer.num_heads, layer.head_dim), dtype=torch.float64)]
    trees = tree_blocks(forward_batch)
    for i in range(forward_batch.batch_size):
        start = forward_batch.extend_start_loc_cpu[i]
        extend = forward_batch.extend_seq_lens_cpu[i]
        seq_len = forward_batch.seq_lens_cpu[i]
        req = int(forward_batch.req_pool_indices[i])
        slots = pool.req_to_token[req, :seq_len].to("cpu")
        outputs.append(
            reference_request_attention(
                q[start : start + extend].to("cpu"),
                k_buf[slots.to(k_buf.device)].to("cpu"),
                v_buf[slots.to(v_buf.device)].to("cpu"),
                prefix_len=forward_batch.prefix_lens_cpu[i],
                scaling=layer.scaling,
                tree=None if trees is None else trees[i],
                sliding_window_size=layer.sliding_window_size,
                logit_cap=layer.logit_cap,
                sinks=sinks,
                causal=layer.is_causal,
            )
        )
    return torch.cat(outputs)


def reference_request_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    prefix_len: int,
    scaling: float,
    tree: torch.Tensor | None = None,
    sliding_window_size: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """One request: ``q`` ``[new, heads, dim]`` over ``k``/``v`` ``[prefix + new, kv_heads, dim]``.

    Query head ``h`` uses KV head ``h // (heads // kv_heads)``, SGLang's GQA
    grouping; query ``i`` sees key ``j`` iff ``j <= prefix_len + i``, or, given
    ``tree`` (``[new, new]`` bool, a speculative tree), iff ``j < prefix_len``
    or ``tree[i, j - prefix_len]``; with ``causal=False`` it sees every key.
    With a window it sees, of those, the keys whose position is at most
    ``sliding_window_size`` before its own: key ``j``'s position is ``j``,
    except a tree's new token's, which is ``prefix_len`` plus its depth (its
    ancestors in the tree). ``logit_cap > 0`` maps each score ``s`` to
    ``logit_cap * tanh(s / logit_cap)``; ``sinks`` adds ``exp(sinks[h])`` to
    head ``h``'s softmax denominator. A query that sees no key at all gets zeros.
    """
    num_new, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    if seq_len != prefix_len + num_new:
        raise ValueError(f"reference: {seq_len} keys for prefix {prefix_len} + {num_new} new tokens")
    if tree is not None and not causal:
        raise ValueError("reference: a speculative tree over a non-causal layer has no meaning")
    group = num_heads // num_kv_heads
    # query head h = g * group + j reads KV head g: the queries viewed as [new, kv_heads, group, dim]
    q64 = q.to(torch.float64).reshape(num_new, num_kv_heads, group, -1)
    k64 = k.to(torch.float64)
    v64 = v.to(torch.float64)
    scores = torch.einsum("qgjd,kgd->gjqk", q64, k64).reshape(num_heads, num_new, seq_len) * scaling
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    positions = torch.arange(seq_len)
    if tree is None:
        visible = (
            causal_mask(num_new, seq_len, prefix_len) if causal else torch.ones(num_new, seq_len, dtype=torch.bool)
        )
    else:
        if tuple(tree.shape) != (num_new, num_new):
            raise ValueError(f"reference: a tree mask of shape {tuple(tree.shape)} for {num_new} new tokens")
        tree = tree.to("cpu", torch.bool)
        visible = torch.cat([torch.ones((num_new, prefix_len), dtype=torch.bool), tree], 1)
        depth = tree.sum(dim=1) - tree.diagonal().to(torch.int64)  # the ancestors each new token sees
        positions = torch.cat([positions[:prefix_len], prefix_len + depth])
    if sliding_window_size >= 0:
        query_positions = positions[prefix_len:].unsqueeze(1)
        visible = visible & (query_positions - positions.unsqueeze(0) <= sliding_window_size)
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to("cpu", torch.float64).view(num_heads, 1, 1).expand(num_heads, num_new, 1)
        peak = torch.maximum(peak, sink)
    weights = torch.exp(scores - peak)
    denominator = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - peak)
    weights = weights / denominator
    # A query that sees no key (a tree row all False, no prefix) gets zeros, as the contract says: its softmax
    # above is 0/0, so its weights are set, not computed.
    weights = weights.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    out = torch.einsum("gjqk,kgd->qgjd", weights.view(num_kv_heads, group, num_new, seq_len), v64)
    return out.reshape(num_new, num_heads, -1)


def causal_mask(num_new: int, seq_len: int, prefix_len: int) -> torch.Tensor:
    """``[num_new, seq_len]`` bool, True where new token ``i`` may see key ``j`` (``j <= prefix + i``)."""
    rows = torch.arange(num_new).unsqueeze(1) + prefix_len
    cols = torch.arange(seq_len).unsqueeze(0)
    return cols <= rows


def tree_blocks(forward_batch: ForwardBatch) -> list[torch.Tensor] | None:
    """``forward_batch.tree_mask`` cut into each request's ``[extend_len, extend_len]`` block (on the CPU), or
    ``None`` when the batch is causal."""
    if forward_batch.tree_mask is None:
        return None
    lens = forward_batch.extend_seq_lens_cpu
    cells = forward_batch.tree_mask.to("cpu").split_with_sizes([e * e for e in lens])
    return [block.view(e, e) for block, e in zip(cells, lens, strict=True)]


def tree_mask(*parents: Sequence[int]) -> torch.Tensor:
    """``ForwardBatch.tree_mask`` for one request per parent list (``-1``: the root): each token sees its ancestors."""
    blocks = []
    for tree in parents:
        block = torch.eye(len(tree), dtype=torch.bool)
        for token, parent in enumerate(tree):
            if parent >= 0:
                block[token] |= block[parent]
        blocks.append(block.flatten())
    return torch.cat(blocks)
