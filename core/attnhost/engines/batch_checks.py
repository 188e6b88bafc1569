"""Once-per-batch checks of what an engine hands a backend: the lengths, the write slots and the request rows,
without a host sync.

A kernel trusts these numbers: a write slot outside the cache is a write outside its buffer, a slot given twice
makes one token's K/V silently another's, and a length beyond the request table reads slots that hold nothing. The
engines' own kernels trust them too, so a wrong batch from a speculative worker shows up as wrong tokens, never as
an error. The checks run once per batch, before the backend plans it, and split by where the numbers live:

* what the engine's host copies say (the lengths of an extend or a decode, the number of write slots) is checked on
  the host, where reading costs nothing;
* what only the device holds (the slots, the request rows, the device's lengths against the host's) becomes one
  boolean on the device and one ``torch._assert_async``: on a GPU a device-side assert that fails the step without
  the host ever waiting for it (engines overlap the next batch's scheduling with this one's forward, and a read
  here would be a stream synchronisation per step), on a CPU an immediate error.

Only when the assert fails is the batch read on the host, to name the offending entry with its index and value
(on a CPU, before anything is written; on a GPU the step fails at its next synchronisation, and rerunning with
``CUDA_LAUNCH_BLOCKING=1`` names it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnhost.errors import InvalidBatchError

__all__ = ["check_device_batch", "check_host_lengths", "integer_vector"]

NOTHING_DONE = "nothing was read or written"


def integer_vector(where: str, name: str, tensor: Tensor) -> Tensor:
    """``tensor`` as int64 if it is a 1-D integer tensor (its dtype and shape only: no read), else refused."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise InvalidBatchError(f"{where}: {name} must hold integers, got {tensor.dtype}; {NOTHING_DONE}")
    if tensor.dim() != 1:
        raise InvalidBatchError(f"{where}: {name} must be 1-D, got shape {tuple(tensor.shape)}; {NOTHING_DONE}")
    return tensor if tensor.dtype == torch.int64 else tensor.to(torch.int64)


def check_host_lengths(
    where: str,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    table_shape: Sequence[int],
    num_write_slots: int,
    way_out: str,
) -> None:
    """The host's lengths: prefixes not negative, at least one new token each, every request's context within the
    request table's width (beyond it a kernel reads slots that were never recorded), one write slot per new token."""
    width = table_shape[1]
    for request, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        if prefix < 0 or extend < 1:
            raise InvalidBatchError(
                f"{where}: request {request} has a prefix of {prefix} and {extend} new tokens (a prefix is never "
                f"negative and a request brings at least one token); {NOTHING_DONE} — {way_out}"
            )
        if prefix + extend > width:
            raise InvalidBatchError(
                f"{where}: request {request} spans {prefix + extend} tokens, beyond the request table's "
                f"{width} columns; {NOTHING_DONE} — {way_out}"
            )
    if num_write_slots != sum(extend_lens):
        raise InvalidBatchError(
            f"{where}: the batch brings {sum(extend_lens)} new tokens but {num_write_slots} write slots "
            f"(out_cache_loc); {NOTHING_DONE} — {way_out}"
        )


def check_device_batch(
    where: str,
    *,
    seq_lens: Tensor,
    out_cache_loc: Tensor,
    req_pool_indices: Tensor,
    host_seq_lens: Sequence[int],
    host_lengths_exact: bool,
    extend_lens: Sequence[int],
    num_slots: int,
    num_rows: int,
    way_out: str,
    padding_slot: int | None = None,
) -> None:
    """Every write slot inside the cache and none given twice (``padding_slot``: the one slot an engine's padded
    rows may all write, SGLang's reserved slot 0 in a graph batch), every request row inside the request table, and
    the device's lengths equal to the host's (or, where the host's are only bounds, within them and covering the
    new tokens): one device-side assert, no read unless it fails."""
    seq = integer_vector(where, "seq_lens", seq_lens)
    loc = integer_vector(where, "out_cache_loc", out_cache_loc)
    rows = integer_vector(where, "req_pool_indices", req_pool_indices)
    if not loc.numel() or not rows.numel():
        raise InvalidBatchError(f"{where}: a batch with no new tokens or no requests is not IDLE; nothing was run")
    if seq.numel() != len(host_seq_lens) or rows.numel() != len(host_seq_lens):
        raise InvalidBatchError(
            f"{where}: the batch has {len(host_seq_lens)} requests but {seq.numel()} seq_lens and {rows.numel()} "
            f"req_pool_indices; {NOTHING_DONE} — {way_out}"
        )
    host = torch.tensor(host_seq_lens, dtype=torch.int64).to(seq.device, non_blocking=True)
    if host_lengths_exact:
        lengths_ok = (seq == host).all()
    else:
        extend = torch.tensor(extend_lens, dtype=torch.int64).to(seq.device, non_blocking=True)
        lengths_ok = ((seq <= host) & (seq >= extend)).all()
    ordered = loc.sort().values
    repeats = ordered[1:] == ordered[:-1]
    if padding_slot is not None:
        repeats &= ordered[1:] != padding_slot
    ok = (
        lengths_ok
        & (ordered[0] >= 0)
        & (ordered[-1] < num_slots)
        & ~repeats.any()
        & (rows.min() >= 0)
        & (rows.max() < num_rows)
    )
    try:
        torch._assert_async(ok, f"{where}: a batch failed attnhost's checks; rerun with CUDA_LAUNCH_BLOCKING=1")
    except RuntimeError:  # a CPU tensor: the assert ran now, so the batch may be read to name the entry
        _name_the_entry(
            where, seq, loc, rows, host_seq_lens, host_lengths_exact, (num_slots, num_rows), padding_slot, way_out
        )
        raise InvalidBatchError(f"{where}: the batch failed attnhost's checks; {NOTHING_DONE} — {way_out}") from None


def _name_the_entry(
    where: str,
    seq: Tensor,
    loc: Tensor,
    rows: Tensor,
    host_seq_lens: Sequence[int],
    exact: bool,
    sizes: tuple[int, int],
    padding_slot: int | None,
    way_out: str,
) -> None:
    """The failed check's first offending entry, read on the host (only after the device-side assert failed)."""
    num_slots, num_rows = sizes
    slots: list[int] = loc.tolist()
    for index, slot in enumerate(slots):
        if not 0 <= slot < num_slots:
            raise InvalidBatchError(
                f"{where}: out_cache_loc[{index}] = {slot} is not a slot of the KV cache (slots 0 to "
                f"{num_slots - 1}); {NOTHING_DONE} — {way_out}"
            )
    first: dict[int, int] = {}
    for index, slot in enumerate(slots):
        if slot in first and slot != padding_slot:
            raise InvalidBatchError(
                f"{where}: out_cache_loc[{first[slot]}] and out_cache_loc[{index}] are both slot {slot}, so one "
                f"token's K/V would overwrite another's; {NOTHING_DONE} — {way_out}"
            )
        first[slot] = index
    for row in rows.tolist():
        if not 0 <= row < num_rows:
            raise InvalidBatchError(
                f"{where}: req_pool_indices holds {row}, not a row of the request table (rows 0 to {num_rows - 1}); "
                f"{NOTHING_DONE} — {way_out}"
            )
    device: list[int] = seq.tolist()
    if exact:
        raise InvalidBatchError(
            f"{where}: this batch's host lengths (prefix + new tokens {list(host_seq_lens)}) disagree with its "
            f"device seq_lens {device}, so neither can be trusted; {NOTHING_DONE} — {way_out}"
        )
    raise InvalidBatchError(
        f"{where}: this batch's device seq_lens {device} exceed the engine's host bounds {list(host_seq_lens)} or "
        f"leave a request fewer tokens than it brings; {NOTHING_DONE} — {way_out}"
    )
