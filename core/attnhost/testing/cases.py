"""The kit's own parametrized cases, torch-free: the pytest plugin reads their ids back from pasted node ids."""

from __future__ import annotations

__all__ = ["HEAD_LAYOUTS", "SPECULATIVE_TREES"]

HEAD_LAYOUTS: dict[str, tuple[int, int]] = {"mha-4-4": (4, 4), "gqa-8-2": (8, 2), "mqa-8-1": (8, 1)}
"""``id: (num_heads, num_kv_heads)`` of the head-layout test: multi-head, grouped-query, multi-query."""

SPECULATIVE_TREES: dict[str, tuple[int, ...]] = {
    # topk 2: the root (the last committed token), two candidates, then each candidate's best continuations
    "topk2-4": (-1, 0, 0, 1),
    "topk2-6-wide": (-1, 0, 0, 1, 2, 1),
    "topk2-6-deep": (-1, 0, 1, 0, 2, 4),
    "topk2-6-late-sibling": (-1, 0, 1, 2, 3, 0),
    # topk 3: three candidates per step, kept by score, so a deep branch may come before a sibling
    "topk3-8-wide": (-1, 0, 0, 0, 1, 2, 3, 1),
    "topk3-8-deep": (-1, 0, 1, 0, 3, 2, 0, 6),
}
"""``id: parents``: the speculative trees the tree-verify test sends, as each draft token's parent among the new
tokens (``-1``: the root); a token sees the prefix, itself and its ancestors."""
