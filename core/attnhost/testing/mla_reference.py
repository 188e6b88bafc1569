"""The trusted MLA attention backends are compared against, in both forms (docs/mla.md).

As naive as :mod:`attnhost.testing.reference`, whose per-request float64 loop it reuses: the absorbed form is
written out as what it means (keys: each token's whole latent row, values: that row's first ``kv_lora_rank``
columns, one KV head shared by every query head) and the MHA form as plain causal attention over the arguments.
"""

from __future__ import annotations

import torch

from attnhost.backend import AttentionLayer
from attnhost.forward_batch import ForwardBatch
from attnhost.mla import MLAForm
from attnhost.testing.reference import reference_request_attention, tree_blocks

__all__ = ["reference_mla_absorbed", "reference_mla_mha"]


def reference_mla_absorbed(
    q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch, latent: torch.Tensor
) -> torch.Tensor:
    """``[num_new_tokens, num_heads, kv_lora_rank]`` in float64: ``q`` ``[tokens, heads, latent_dim]`` (rope part
    already joined) over ``latent`` (``[num_slots, 1, latent_dim]``: the cache as it must be after the write)."""
    mla = layer.mla
    if mla is None or layer.mla_form is not MLAForm.ABSORBED:
        raise ValueError(f"reference: layer {layer.layer_id} is not an MLA layer in the absorbed form")
    pool = forward_batch.kv_pool
    rows = latent.to("cpu", torch.float64)
    q = q.reshape(-1, layer.num_heads, mla.latent_dim)
    outputs = [torch.zeros((0, layer.num_heads, mla.kv_lora_rank), dtype=torch.float64)]
    trees = tree_blocks(forward_batch)
    for i in range(forward_batch.batch_size):
        start, extend = forward_batch.extend_start_loc_cpu[i], forward_batch.extend_seq_lens_cpu[i]
        slots = pool.req_to_token[int(forward_batch.req_pool_indices[i]), : forward_batch.seq_lens_cpu[i]].to("cpu")
        keys = rows[slots]
        outputs.append(
            reference_request_attention(
                q[start : start + extend].to("cpu"),
                keys,
                keys[..., : mla.kv_lora_rank].clone(),
                prefix_len=forward_batch.prefix_lens_cpu[i],
                scaling=layer.scaling,
                tree=None if trees is None else trees[i],
            )
        )
    return torch.cat(outputs)


def reference_mla_mha(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
) -> torch.Tensor:
    """``[num_new_tokens, num_heads, v_head_dim]`` in float64: each request's queries over its own rows of ``k``
    (``[tokens, heads, qk_head_dim]``) and ``v`` (``[tokens, heads, v_head_dim]``), causally (or by its tree)."""
    if layer.mla_form is not MLAForm.MHA:
        raise ValueError(f"reference: layer {layer.layer_id} is not an MLA layer in the MHA form")
    outputs = [torch.zeros((0, layer.num_heads, layer.v_head_dim), dtype=torch.float64)]
    trees = tree_blocks(forward_batch)
    for i in range(forward_batch.batch_size):
        start, extend = forward_batch.extend_start_loc_cpu[i], forward_batch.extend_seq_lens_cpu[i]
        rows = slice(start, start + extend)
        outputs.append(
            reference_request_attention(
                q[rows].to("cpu"),
                k[rows].to("cpu"),
                v[rows].to("cpu"),
                prefix_len=0,
                scaling=layer.scaling,
                tree=None if trees is None else trees[i],
            )
        )
    return torch.cat(outputs)
