"""The kit's own parametrized cases, torch-free: the pytest plugin reads their ids back from pasted node ids."""

from __future__ import annotations

import dataclasses

__all__ = ["CASE_IDS", "HEAD_LAYOUTS", "PRODUCTION_SHAPES", "SPECULATIVE_TREES", "ProductionShape"]

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
    # what EAGLE's longer drafts build: a chain seven deep, a sibling at depth 2 with a child of its own
    "topk2-10-deep7": (-1, 0, 1, 2, 3, 4, 5, 6, 1, 8),
}
"""``id: parents``: the speculative trees the tree-verify test sends, as each draft token's parent among the new
tokens (``-1``: the root); a token sees the prefix, itself and its ancestors."""


@dataclasses.dataclass(frozen=True)
class ProductionShape:
    """One production-shape case of the kit: a served model's attention at its real sizes, and the cache and batches
    an engine gives it (``test_production_shapes``).

    Requests ``i`` starts with ``contexts[i]`` cached tokens (written by the kit, every third one's pages in
    descending order), then runs three batches through every layer: an extend of ``extend[i]`` new tokens for each
    request with ``extend[i] > 0``, a decode of every request, and a target-verify of every other request (a tree
    seven deep where the backend declares ``tree_mask``, else a chain)."""

    model: str
    """What the shape stands for, in failure messages."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    contexts: tuple[int, ...]
    extend: tuple[int, ...]
    table_dtype: str
    """``req_to_token``'s dtype: ``int32`` (SGLang's) or ``int64``."""
    fused_kv: bool
    """Each layer's K and V in one buffer, so the backend reads strided views."""
    high_slots: bool
    """The cache is larger than 32,768 slots and the requests' slots straddle that line (a 16-bit index overflows)."""
    variants: tuple[tuple[tuple[str, float | bool], ...], ...] = ()
    """Each layer's window, soft-cap or sinks (the last for the rest), applied where the backend declares them."""
    query_scale: float = 1.0
    """Multiplies the queries: scores of the size trained models reach, where a soft-cap of tens bends them."""


PRODUCTION_SHAPES: dict[str, ProductionShape] = {
    "gqa-32-8-d128": ProductionShape(
        model="Llama 3 8B's attention",
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_layers=3,
        contexts=(2100, 1, 96, 0, 517, 13, 300, 91, 0, 40, 1200, 7, 64, 255, 1, 33, 128, 0, 700, 5),
        extend=(0, 12, 160, 1, 0, 33, 0, 7, 64, 0, 2, 0, 19, 0, 1, 0, 5, 96, 0, 3),
        table_dtype="int32",
        fused_kv=True,
        high_slots=False,
    ),
    "gqa-32-4-d64": ProductionShape(
        model="gpt-oss's attention (windows of 128 and sinks where declared)",
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        num_layers=2,
        contexts=(1500, 3, 130, 0, 64, 800, 1, 257, 20, 0, 400, 9),
        extend=(4, 0, 30, 128, 1, 0, 9, 0, 2, 50, 0, 17),
        table_dtype="int64",
        fused_kv=False,
        high_slots=True,
        variants=((("sliding_window_size", 128), ("has_sinks", True)), (("has_sinks", True),)),
    ),
    "gqa-16-8-d256": ProductionShape(
        model="Gemma 2's attention (windows of 64 and a soft-cap of 50 where declared)",
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        num_layers=2,
        contexts=(900, 0, 70, 1, 333, 49, 0, 128, 15, 600),
        extend=(3, 200, 0, 8, 1, 0, 64, 2, 0, 11),
        table_dtype="int32",
        fused_kv=True,
        high_slots=False,
        variants=((("sliding_window_size", 64), ("logit_cap", 50.0)), (("logit_cap", 50.0),)),
        query_scale=4.0,
    ),
}
"""``id: shape``: together they reach head dims of 64 to 256, 16 to 32 heads, contexts of thousands, batches of a
dozen and more requests on rows past 8, int32 tables, strided caches, slots past 32,767, windows of 50 and more,
soft-caps of 10 and more, trees deeper than 5 and layer ids past 1, each at least once."""

CASE_IDS: tuple[str, ...] = (*HEAD_LAYOUTS, *PRODUCTION_SHAPES)
"""Every id the kit's own parametrized cases add to a node id (the pytest plugin strips them to find the backend)."""
