"""``batched_matmul``'s per-batch plan: where each real query sits in the padded layout, and per layer kind
(window, causality) the keys every request reads and the mask over them.

Both kernel modules read it, the dense one (``backend.py``) and the MLA ones (``mla.py``), so it is a module of
its own that both import: neither kernel module imports the other's internals, and the backend module imports the
MLA kernels one way only. How the keys and mask are chosen is told in ``backend.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnhost import AttentionLayer, ForwardBatch

__all__ = ["Keys", "Metadata"]


@dataclass(frozen=True, slots=True)
class Keys:
    """Which keys the layers of one kind (window, causality) read in this batch, and which of them each query sees."""

    key_slots: torch.Tensor  # [B, L] cache slot of every (request, key column); padding: the request's last
    blocked: torch.Tensor  # [B, T, L] True where the query may NOT attend to the key (masked to -inf)
    blind: torch.Tensor | None  # [B, T] True for a query that sees no key (output zeros); None: none does


@dataclass(frozen=True, slots=True)
class Metadata:
    """One batch's plan: its padded query layout, made once by ``init_forward_metadata``, and its key plans, one
    per layer kind, made by the first layer of each kind."""

    batch: ForwardBatch
    query_valid: torch.Tensor  # [B, T] True for real (not padding) query rows, in token order
    query_rows: torch.Tensor  # [tokens] where each real query sits in the padded layout flattened to [B * T]
    prefixed: tuple[int, int] | None  # (request, prefix length) of the first request with a cached prefix
    kinds: dict[tuple[int, bool], Keys]  # key plans by (sliding_window_size, is_causal), filled as layers come

    def keys(self, layer: AttentionLayer) -> Keys:
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


def _plan_keys(
    forward_batch: ForwardBatch, query_valid: torch.Tensor, window: int, causal: bool, layer_id: int
) -> Keys:
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
    return Keys(key_slots, ~visible, blind)


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
