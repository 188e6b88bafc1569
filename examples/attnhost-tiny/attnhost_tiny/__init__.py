"""A complete attention backend in one class, registered by the one-line shorthand.

The entry point names this class, so discovery (``attnhost list``) imports
this module. It must therefore not import torch at module level: torch is
imported inside the methods that run attention, and named for type checkers
only under ``TYPE_CHECKING``. Subclassing ``attnhost.AttentionBackend`` is
free — attnhost keeps that module torch-free for exactly this reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnhost import AttentionBackend, AttentionLayer, BackendCapabilities

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost import ForwardBatch

__all__ = ["TinyAttnBackend"]


class TinyAttnBackend(AttentionBackend):
    """Per-request einsum attention in float32, in about fifty lines (example plugin)."""

    # tree_mask: it reads ForwardBatch.tree_mask, so engines may send it speculative trees (EAGLE topk > 1), not only
    # chains; cuda_graph: it reads no device value on the host (docs/graphs.md), so engines may capture its steps
    capabilities = BackendCapabilities(tree_mask=True, cuda_graph=True)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Nothing to precompute: every layer reads the slot table directly."""

    def forward_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> Tensor:
        import torch  # here, not at module level: `attnhost list` imports this module

        pool = forward_batch.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        group = layer.num_heads // layer.num_kv_heads
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        tree_cell = 0  # where request i's [new, new] block starts in forward_batch.tree_mask
        for i in range(forward_batch.batch_size):
            # the new-token counts are exact on the host; the lengths there may be bounds (a captured graph's), so the
            # exact ones are used as tensors, never read: key columns past the length reread the last key, masked
            start, new, bound = (
                forward_batch.extend_start_loc_cpu[i],
                forward_batch.extend_seq_lens_cpu[i],
                forward_batch.seq_lens_cpu[i],
            )
            prefix, last = forward_batch.prefix_lens[i : i + 1], forward_batch.seq_lens[i : i + 1] - 1
            columns = torch.arange(bound, device=q.device)
            table_row = pool.req_to_token.index_select(0, forward_batch.req_pool_indices[i : i + 1])[0]
            slots = table_row.gather(0, torch.minimum(columns, last)).long()
            keys = pool.k_buffer(layer.layer_id)[slots].float().repeat_interleave(group, dim=1)
            values = pool.v_buffer(layer.layer_id)[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q[start : start + new].float(), keys) * layer.scaling
            # new token t sits at position prefix + t and sees keys 0..prefix + t
            visible = columns <= prefix + torch.arange(new, device=q.device)[:, None]
            if forward_batch.tree_mask is not None:  # a speculative tree: the prefix, then only its ancestors
                block = forward_batch.tree_mask[tree_cell : tree_cell + new * new].view(new, new)
                among_new = columns - prefix  # a key's index among the new tokens (< 0: the prefix)
                ancestors = block[:, among_new.clamp(0, new - 1)]
                visible = torch.where((among_new >= 0) & (among_new < new), ancestors, among_new < 0)
                tree_cell += new * new
            weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            if forward_batch.tree_mask is not None:  # a tree row may hide every key: 0, not 0/0
                weights = weights.masked_fill(~visible, 0.0)
            out[start : start + new] = torch.einsum("hts,shd->thd", weights, values).to(q.dtype)
        return out
