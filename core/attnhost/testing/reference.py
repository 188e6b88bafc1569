"""The trusted attention every backend is compared against.

Deliberately naive: float64, an explicit loop over requests, KV heads
repeated by hand, the causal mask written out, softmax by definition.  It
shares no code path with any backend (no SDPA), so agreement means something.
It reads keys and values from the KV cache, exactly as a backend must, so the
cache has to hold the new tokens' K/V before it is called.
"""

from __future__ import annotations

import torch

from attnhost.backend import AttentionLayer
from attnhost.forward_batch import ForwardBatch

__all__ = ["causal_mask", "reference_attention", "reference_request_attention"]


def reference_attention(
    q: torch.Tensor,
    layer: AttentionLayer,
    forward_batch: ForwardBatch,
    *,
    k_buffer: torch.Tensor | None = None,
    v_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``[num_new_tokens, num_heads, head_dim]`` in float64.

    ``q`` holds the batch's new tokens in request order.  Keys and values come
    from ``forward_batch.kv_pool`` for ``layer.layer_id`` unless ``k_buffer`` /
    ``v_buffer`` (``[num_slots, num_kv_heads, head_dim]``) are given, e.g. a
    snapshot taken before a backend could have touched the cache.
    """
    pool = forward_batch.kv_pool
    k_buf = pool.k_buffer(layer.layer_id) if k_buffer is None else k_buffer
    v_buf = pool.v_buffer(layer.layer_id) if v_buffer is None else v_buffer
    q = q.reshape(-1, layer.num_heads, layer.head_dim)
    outputs = [torch.zeros((0, layer.num_heads, layer.head_dim), dtype=torch.float64)]
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
) -> torch.Tensor:
    """One request: ``q`` ``[new, heads, dim]`` over ``k``/``v`` ``[prefix + new, kv_heads, dim]``.

    Query head ``h`` uses KV head ``h // (heads // kv_heads)``, SGLang's GQA
    grouping; query ``i`` sees key ``j`` iff ``j <= prefix_len + i``.
    """
    num_new, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    if seq_len != prefix_len + num_new:
        raise ValueError(f"reference: {seq_len} keys for prefix {prefix_len} + {num_new} new tokens")
    group = num_heads // num_kv_heads
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)  # [seq, heads, dim]
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * scaling
    scores = scores.masked_fill(~causal_mask(num_new, seq_len, prefix_len), float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", weights, v64)


def causal_mask(num_new: int, seq_len: int, prefix_len: int) -> torch.Tensor:
    """``[num_new, seq_len]`` bool, True where new token ``i`` may see key ``j`` (``j <= prefix + i``)."""
    rows = torch.arange(num_new).unsqueeze(1) + prefix_len
    cols = torch.arange(seq_len).unsqueeze(0)
    return cols <= rows
