"""The kit's own parametrized cases, torch-free: the pytest plugin reads their ids back from pasted node ids."""

from __future__ import annotations

__all__ = ["HEAD_LAYOUTS"]

HEAD_LAYOUTS: dict[str, tuple[int, int]] = {"mha-4-4": (4, 4), "gqa-8-2": (8, 2), "mqa-8-1": (8, 1)}
"""``id: (num_heads, num_kv_heads)`` of the head-layout test: multi-head, grouped-query, multi-query."""
