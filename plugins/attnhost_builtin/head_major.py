"""A KV cache buffer read head-major: ``[slots, kv_heads, dim]`` viewed as ``[slots * kv_heads, dim]`` rows, so a
gather lays each KV head's keys out contiguously, as SDPA reads them.

The batch plan (plan.py) indexes a lone request's keys this way and the decode path (torch_native.py) gathers
through it, so the layout has a module of its own that both import.
"""

from __future__ import annotations

import torch

__all__ = ["gather_head_major", "head_major_index", "head_rows"]


def head_major_index(slots: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n, width]`` slots as the ``[n, heads, width]`` row numbers of ``head_rows``, flattened."""
    per_head = torch.arange(heads, dtype=torch.int64, device=slots.device).view(1, -1, 1)
    return (slots.to(torch.int64).unsqueeze(1) * heads + per_head).view(-1)


def head_rows(buffer: torch.Tensor) -> torch.Tensor | None:
    """``buffer`` (``[slots, kv_heads, dim]``) as ``[slots * kv_heads, dim]`` rows, or None if no view allows it.

    A lone request's keys are gathered through it in head-major order: SDPA
    splits one request between threads by KV head, and the gather then splits
    the same way, so each thread reads back rows it wrote itself. Gathered
    token-major, half of every head is written by the other core, and on two
    threads fetching it cost as much as the gather and SDPA together
    (BENCHMARKS.md, "SGLang bridge"). A chunk of several requests is split by
    request in both, so it stays token-major: fewer, longer row copies.
    """
    slots, heads, dim = buffer.shape
    if heads > 1 and buffer.stride(0) != heads * buffer.stride(1):
        return None  # e.g. a cache whose heads are a slice of a wider tensor
    return buffer.view(slots * heads, dim)


def gather_head_major(
    rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None, heads: int, width: int
) -> torch.Tensor:
    """``index`` (from ``head_major_index``) gathered from ``rows`` (``head_rows``) into ``out`` (any shape of the
    right size), as ``[requests, heads, width, dim]``: each head's keys contiguous, as SDPA reads them."""
    dim = rows.shape[1]
    gathered = torch.index_select(rows, 0, index, out=None if out is None else out.view(-1, dim))
    return gathered.view(-1, heads, width, dim)
