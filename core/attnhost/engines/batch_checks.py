"""Once-per-batch checks of what an engine hands a backend: the lengths, the write slots and the request rows.

A kernel trusts these numbers: a write slot outside the cache is a write outside its buffer, a slot given twice
makes one token's K/V silently another's, and a length beyond the request table reads slots that hold nothing. The
engines' own kernels trust them too, so a wrong batch from a speculative worker shows up as wrong tokens, never as
an error. The checks run once per batch, before the backend plans it, and read everything they need from the
device in one transfer (a batch's lengths, the slots' lowest and highest value, whether one repeats, the request
rows' range), so the per-layer path pays nothing. Only when a check fails is the offending entry looked up, to be
named with its index and value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnhost.errors import InvalidBatchError

__all__ = ["BatchFacts", "check_lengths", "check_slots", "read_batch_facts"]


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """What one transfer from the device says about a batch."""

    seq_lens: tuple[int, ...]
    """The device tensor's values: the authoritative lengths where an engine's host copy is only a bound."""
    lowest_slot: int
    highest_slot: int
    repeats_a_slot: bool
    lowest_row: int
    highest_row: int


def _integer(where: str, name: str, tensor: Tensor) -> Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise InvalidBatchError(f"{where}: {name} must hold integers, got {tensor.dtype}; nothing was read or written")
    if tensor.dim() != 1:
        raise InvalidBatchError(
            f"{where}: {name} must be 1-D, got shape {tuple(tensor.shape)}; nothing was read or written"
        )
    return tensor.to(torch.int64)


def read_batch_facts(where: str, seq_lens: Tensor, out_cache_loc: Tensor, req_pool_indices: Tensor) -> BatchFacts:
    """The facts of a non-empty batch, in one device-to-host transfer."""
    seq = _integer(where, "seq_lens", seq_lens)
    loc = _integer(where, "out_cache_loc", out_cache_loc)
    rows = _integer(where, "req_pool_indices", req_pool_indices)
    if not loc.numel() or not rows.numel():
        raise InvalidBatchError(f"{where}: a batch with no new tokens or no requests is not IDLE; nothing was run")
    ordered = loc.sort().values
    repeats = (ordered[1:] == ordered[:-1]).any() if loc.numel() > 1 else loc.new_zeros(())
    tail = torch.stack([ordered[0], ordered[-1], repeats.to(torch.int64), rows.min(), rows.max()])
    values: list[int] = torch.cat([seq, tail]).tolist()
    *lengths, lowest, highest, repeated, first_row, last_row = values
    return BatchFacts(tuple(lengths), lowest, highest, bool(repeated), first_row, last_row)


def check_slots(where: str, facts: BatchFacts, out_cache_loc: Tensor, num_slots: int, way_out: str) -> None:
    """Every write slot inside the cache and none given twice; else one sentence naming the first bad entry."""
    if facts.lowest_slot < 0 or facts.highest_slot >= num_slots:
        loc = out_cache_loc.to(torch.int64)
        index = int(((loc < 0) | (loc >= num_slots)).nonzero()[0, 0])
        raise InvalidBatchError(
            f"{where}: out_cache_loc[{index}] = {int(loc[index])} is not a slot of the KV cache (slots 0 to "
            f"{num_slots - 1}); nothing was read or written — {way_out}"
        )
    if facts.repeats_a_slot:
        first: dict[int, int] = {}
        for index, slot in enumerate(out_cache_loc.to(torch.int64).tolist()):
            if slot in first:
                raise InvalidBatchError(
                    f"{where}: out_cache_loc[{first[slot]}] and out_cache_loc[{index}] are both slot {slot}, so one "
                    f"token's K/V would overwrite another's; nothing was read or written — {way_out}"
                )
            first[slot] = index


def check_lengths(
    where: str,
    facts: BatchFacts,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    table_shape: Sequence[int],
    way_out: str,
) -> None:
    """Request rows inside the request table; prefixes not negative, at least one new token each, and every
    request's context within the table's width (beyond it a kernel reads slots that were never recorded)."""
    rows, width = table_shape[0], table_shape[1]
    if facts.lowest_row < 0 or facts.highest_row >= rows:
        bad = facts.lowest_row if facts.lowest_row < 0 else facts.highest_row
        raise InvalidBatchError(
            f"{where}: req_pool_indices holds {bad}, not a row of the request table (rows 0 to {rows - 1}); "
            f"nothing was read or written — {way_out}"
        )
    for request, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        if prefix < 0 or extend < 1:
            raise InvalidBatchError(
                f"{where}: request {request} has a prefix of {prefix} and {extend} new tokens (a prefix is never "
                f"negative and a request brings at least one token); nothing was read or written — {way_out}"
            )
        if prefix + extend > width:
            raise InvalidBatchError(
                f"{where}: request {request} spans {prefix + extend} tokens, beyond the request table's "
                f"{width} columns; nothing was read or written — {way_out}"
            )
