"""``torch_native``'s per-batch plan: what ``init_forward_metadata`` decides once and every layer then reads.

For each request: its rows in ``q``, whether its keys are a view or a gather, its masks and SDPA recipes by GQA
group, and its variant layers' query blocks (``Recipe``); for a decode batch, its chunks; for the batch, the
gather scratch and the largest slot it reads. The dense path (torch_native.py), the variant layers
(torch_native_variants.py) and both MLA forms (torch_native_mla.py) all attend on this one plan, so it is a module
of its own that each of them imports, and none of them imports another's internals for it. The thresholds it
applies are the backend's measured numbers (torch_native.py), handed over with each batch as ``Limits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnhost_builtin.head_major import gather_head_major, head_major_index

if TYPE_CHECKING:
    from attnhost.forward_batch import ForwardBatch

__all__ = ["BatchPlan", "Block", "DecodeChunk", "Limits", "Recipe", "RequestPlan", "plan_request", "plan_trees"]


@dataclass(frozen=True, slots=True)
class Limits:
    """The backend's thresholds, as the plan applies them (each one's measurement is told in torch_native.py)."""

    causal_min_tokens: int
    """Above this many query rows a prefix-free request uses SDPA's ``is_causal`` instead of a folded mask."""
    max_folded_mask: int
    """Largest folded mask (elements) worth materialising; beyond it the request is attended unfolded."""
    decode_chunk_bytes: int
    """Bytes of K and V one decode chunk gathers at most (a longer request is a chunk alone)."""


@dataclass(slots=True)
class RequestPlan:
    """How one request is attended: its rows in ``q``, its keys, its mask."""

    q_start: int
    q_len: int
    prefix_len: int
    seq_len: int
    kv_run: tuple[int, int] | None  # contiguous slot range, read as a view
    kv_index: torch.Tensor | None  # gather indices when the slots are fragmented
    limits: Limits  # the batch's: whether to fold, whether is_causal pays
    tree: torch.Tensor | None = None
    """``[q_len, q_len]`` bool: which of its new tokens each new token sees (a speculative tree); None: causal."""
    blind: torch.Tensor | None = None
    """``[q_len, 1, 1]`` bool, True for a new token that sees no key (a tree row all False, no prefix): its
    output is zeros. None (nearly always): every token sees a key."""
    head_index: dict[int, torch.Tensor] = field(default_factory=dict)
    """``kv_index`` as head-major rows (``head_major.head_rows``), by KV head count; built on the first layer."""
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # by GQA group size
    recipes: dict[int, tuple[bool, bool, torch.Tensor | None]] = field(default_factory=dict)
    """(folds, is_causal, mask) by GQA group size: decided on the first layer, reused by the rest."""
    variants: dict[tuple[int, bool, int, int], Recipe] = field(default_factory=dict)
    """How layers with an attention variant attend this request (torch_native_variants.py), by
    (window, causal, query heads, GQA group): decided on the first such layer, reused by the rest."""

    def keys(self, buffer: torch.Tensor, rows: torch.Tensor | None, scratch: torch.Tensor | None) -> torch.Tensor:
        """This request's ``[seq_len, kv_heads, dim]`` rows of a cache buffer (``rows``: its ``head_rows``).

        A contiguous request is a zero-copy view. A fragmented one is gathered
        (head-major when ``rows`` allows, as SDPA splits a request by head)
        into ``scratch``: one tensor per batch, reused by every request in
        turn and by every layer, so it stays hot in cache and no multi-MB
        allocation (page faults) happens per request per layer.
        """
        if self.kv_run is not None:
            return buffer[self.kv_run[0] : self.kv_run[1]]
        assert self.kv_index is not None
        out = None if scratch is None else scratch[: self.seq_len]
        if rows is None:
            return torch.index_select(buffer, 0, self.kv_index, out=out)
        heads = buffer.shape[1]
        index = self.head_index.get(heads)
        if index is None:
            index = self.head_index[heads] = head_major_index(self.kv_index.view(1, -1), heads)
        return gather_head_major(rows, index, out, heads, self.seq_len)[0].transpose(0, 1)

    def uses_is_causal(self, group: int) -> bool:
        """Whether SDPA's top-left ``is_causal`` is exact here (square, no prefix) and cheaper."""
        return (
            self.prefix_len == 0
            and self.tree is None
            and self.q_len > 1
            and (group == 1 or self.q_len >= self.limits.causal_min_tokens or not self._fold_fits(group))
        )

    def folds(self, group: int) -> bool:
        return group > 1 and not self.uses_is_causal(group) and self._fold_fits(group)

    def _fold_fits(self, group: int) -> bool:
        return self.q_len <= 1 or group * self.q_len * self.seq_len <= self.limits.max_folded_mask

    def recipe(self, group: int, device: torch.device) -> tuple[bool, bool, torch.Tensor | None]:
        """How every layer with this GQA group size calls SDPA for this request; computed once.

        Per-layer Python work is per-request overhead on top of SDPA (16
        requests x every layer in a decode step), so the decisions are cached.
        """
        recipe = self.recipes.get(group)
        if recipe is None:
            recipe = self.recipes[group] = (self.folds(group), self.uses_is_causal(group), self.mask(group, device))
        return recipe

    def mask(self, group: int, device: torch.device) -> torch.Tensor | None:
        """The bottom-right-aligned causal mask (or the prefix and the tree), rows repeated per folded head;
        cached."""
        if group not in self.masks:
            self.masks[group] = self._build_mask(group, device)
        return self.masks[group]

    def _build_mask(self, group: int, device: torch.device) -> torch.Tensor | None:
        if self.tree is not None:
            tree = self.tree.to(device)
            allowed = torch.cat([tree.new_ones((self.q_len, self.prefix_len)), tree], dim=1)
            return allowed.repeat(group, 1) if self.folds(group) else allowed
        if self.q_len == 1 or self.uses_is_causal(group):
            return None  # a single query sees every key; is_causal needs no mask
        rows = torch.arange(self.q_len, device=device).unsqueeze(1) + self.prefix_len
        cols = torch.arange(self.seq_len, device=device).unsqueeze(0)
        allowed = cols <= rows
        return allowed.repeat(group, 1) if self.folds(group) else allowed


@dataclass(slots=True)
class DecodeChunk:
    """Decode requests attended by one SDPA call: where they sit in the batch, their padded key slots."""

    rows: slice | torch.Tensor  # the requests' positions in the batch: a slice when consecutive
    index: torch.Tensor
    """What one ``index_select`` gathers: ``[count, width]`` slots (a shorter request repeats its last slot),
    or, when ``head_major``, one request's ``[kv_heads, width]`` rows of the cache viewed as
    ``[slot * kv_heads + head, dim]`` (see ``head_major.head_rows``)."""
    head_major: bool
    count: int
    width: int  # the longest request's keys
    padding: torch.Tensor | None  # [count, 1, 1, width], True where a key is padding; None when there is none
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    """The additive mask (0 or -inf) SDPA gets, by query dtype; built on the first layer."""

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.padding is None:
            return None
        mask = self.masks.get(dtype)
        if mask is None:
            zeros = torch.zeros(self.padding.shape, dtype=dtype, device=self.padding.device)
            mask = self.masks[dtype] = zeros.masked_fill(self.padding, float("-inf"))
        return mask


@dataclass(slots=True)
class BatchPlan:
    """One batch's plan: its requests' plans, and what their layers share (decode chunks, gather scratch)."""

    batch: ForwardBatch
    requests: list[RequestPlan]
    limits: Limits
    decode_table: tuple[torch.Tensor, list[int]] | None = None
    """Set when every request brings one token (unless one request reads a view): the slot table and the
    requests' rows in it, from which the decode chunks are planned."""
    longest_gather: int = 0
    """Rows of the longest fragmented request (0: nothing is gathered); sizes the extend scratch."""
    head_major: bool = field(default_factory=lambda: torch.get_num_threads() > 1)
    """Whether lone requests are gathered head-major (``head_major.head_rows``): it pays only when SDPA splits a
    request between threads; on one thread the token-major gather's longer row copies are cheaper."""
    scratch: dict[tuple[int, torch.dtype, torch.device, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    """Gather targets for fragmented requests, by (K or V, dtype, device, row shape)."""
    chunks: dict[tuple[int, int, bool, int], tuple[list[DecodeChunk], int]] = field(default_factory=dict)
    """Decode chunks and their largest slot count, by (kv heads, bytes of one cache row, whether the cache
    has head-major rows, sliding window or -1)."""
    largest: tuple[int, int, int, int] = (-1, -1, -1, -1)
    """(slot, request, table row, position) of the largest slot any request reads: every layer's buffers must hold
    it (checked per layer in O(1), before anything is written)."""
    variant_masks: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """The masks of variant layers' query blocks (torch_native_variants.py), shared by every block and request
    whose visibility pattern is the same (the band of a sliding window repeats along a long prompt)."""

    def check_reads(self, num_slots: int, layer_id: int) -> None:
        """Refuse a layer whose K/V buffers do not hold every slot the batch reads (a table row that runs off the
        cache would otherwise be read as a truncated view, or fail inside a gather), naming the entry."""
        slot, request, row, position = self.largest
        if slot >= num_slots:
            raise ValueError(
                f"torch_native: req_to_token[{row}, {position}] = {slot} (request {request} of the batch) is not a "
                f"slot of layer {layer_id}'s K/V buffers ({num_slots} slots); the table must name a slot of the KV "
                "cache for every token the batch reads"
            )

    def gather_scratch(self, buffer: torch.Tensor, role: int, rows: int | None = None) -> torch.Tensor | None:
        """A tensor of at least ``rows`` rows (default: the longest fragmented request's), or None for none."""
        rows = self.longest_gather if rows is None else rows
        if not rows:
            return None
        key = (role, buffer.dtype, buffer.device, tuple(buffer.shape[1:]))
        scratch = self.scratch.get(key)
        if scratch is None or len(scratch) < rows:
            scratch = self.scratch[key] = buffer.new_empty((rows, *buffer.shape[1:]))
        return scratch

    def decode_chunks(self, buffer: torch.Tensor, head_major: bool, window: int = -1) -> tuple[list[DecodeChunk], int]:
        """This decode batch in chunks sized for ``buffer``'s rows, and the slots of the largest chunk; with a
        sliding ``window`` each request's chunk row holds only the last ``window + 1`` slots, all its query sees.

        Layers with the same row shape and window share them, so the first layer plans and the rest look up.
        """
        _, heads, dim = buffer.shape
        key = (heads, heads * dim * buffer.element_size(), head_major, window)
        planned = self.chunks.get(key)
        if planned is None:
            assert self.decode_table is not None
            table, rows = self.decode_table
            chunks = _decode_chunks(
                table, rows, self.requests, key[1], heads if head_major else 0, self.limits.decode_chunk_bytes, window
            )
            planned = self.chunks[key] = (chunks, max(chunk.count * chunk.width for chunk in chunks))
        return planned


@dataclass(slots=True)
class Block:
    """Some consecutive queries of a request and the key rows they read."""

    rows: slice  # the queries, within the request
    keys: slice  # their key rows, within the request's rows from Recipe.first_key on
    mask_key: tuple[object, ...] | None  # the block's mask in BatchPlan.variant_masks; None: every key is visible


@dataclass(slots=True)
class Recipe:
    """How one request is attended by the layers of one variant: the key rows it reads, its query blocks."""

    first_key: int  # the first key row any of its queries sees (with a window, the prefix before it is never read)
    blocks: list[Block]
    blind: torch.Tensor | None  # [q_len, 1, 1], True for a query that sees no key (zeros); None: there is none


def plan_request(
    slots_row: torch.Tensor, q_start: int, prefix: int, extend: int, where: tuple[int, int], limits: Limits
) -> tuple[RequestPlan, tuple[int, int]]:
    """Read the request's slots once and pick a view (one ascending run) or a gather; refuse a slot that is negative
    (``where``: the request's index in the batch and its table row) and return the largest slot and its position."""
    seq_len = prefix + extend
    slots = slots_row[:seq_len]
    request, row = where
    if slots.shape[0] < seq_len:
        raise ValueError(
            f"torch_native: request {request} of the batch reads {seq_len} positions of req_to_token row {row}, "
            f"which has {slots.shape[0]}"
        )
    low, high = (int(x) for x in torch.aminmax(slots))
    if low < 0:
        position = int(torch.argmin(slots))
        raise ValueError(
            f"torch_native: req_to_token[{row}, {position}] = {low} (request {request} of the batch) is not a slot; "
            "the table must name a slot of the KV cache for every token the batch reads"
        )
    first = int(slots[0])
    steps = slots[1:] - slots[:-1]
    contiguous = bool((steps == 1).all())
    return RequestPlan(
        q_start=q_start,
        q_len=extend,
        prefix_len=prefix,
        seq_len=seq_len,
        kv_run=(first, first + seq_len) if contiguous else None,
        kv_index=None if contiguous else slots.clone(),
        limits=limits,
    ), (high, int(torch.argmax(slots)))


def plan_trees(plans: list[RequestPlan], tree_mask: torch.Tensor) -> None:
    """Give each request its ``[q_len, q_len]`` block of the batch's tree mask (views, no copy).

    A one-token request whose block is True sees every key, as in decode, so it keeps no block and the batch
    can still take the decode path; checking those blocks is one device sync for the batch, not one each.
    """
    blocks = tree_mask.split_with_sizes([plan.q_len * plan.q_len for plan in plans])
    singles = [i for i, plan in enumerate(plans) if plan.q_len == 1]
    single_all_true = bool(torch.cat([blocks[i] for i in singles]).all()) if singles else True
    for plan, block in zip(plans, blocks, strict=True):
        if plan.q_len > 1 or not single_all_true:
            plan.tree = block.view(plan.q_len, plan.q_len)
    # A token sees no key only where a request without a prefix has an all-False tree row; one sync finds them.
    blind = [(plan, ~plan.tree.any(dim=1)) for plan in plans if plan.tree is not None and plan.prefix_len == 0]
    if blind:
        found = torch.stack([rows.any() for _, rows in blind]).tolist()
        for (plan, rows), any_blind in zip(blind, found, strict=True):
            if any_blind:
                plan.blind = rows.view(-1, 1, 1)


def _decode_chunks(
    table: torch.Tensor,
    rows: list[int],
    plans: list[RequestPlan],
    row_bytes: int,
    head_major_heads: int,
    chunk_bytes: int,
    window: int = -1,
) -> list[DecodeChunk]:
    """Group a decode batch's requests into chunks of similar length, each gathered and attended at once.

    Sorting by length keeps the padding small when lengths differ; a chunk
    closes when its padded K and V rows would pass ``chunk_bytes``.
    Given ``head_major_heads``, a chunk of one request indexes one head's
    row at a time (see ``head_major.head_rows``). With a sliding ``window`` (``>= 0``)
    a request's row holds only its last ``window + 1`` slots: the keys its
    query sees, so a windowed decode reads the window, not the whole cache.
    """
    starts = [max(0, plan.seq_len - window - 1) if window >= 0 else 0 for plan in plans]
    lengths = [plan.seq_len - start for plan, start in zip(plans, starts, strict=True)]
    order = sorted(range(len(plans)), key=lambda i: lengths[i])
    groups: list[list[int]] = [[]]
    for i in order:
        group = groups[-1]
        if group and 2 * (len(group) + 1) * lengths[i] * row_bytes > chunk_bytes:
            groups.append(group := [])
        group.append(i)
    chunks = []
    for group in groups:
        width = lengths[group[-1]]
        slots = torch.empty((len(group), width), dtype=torch.int64, device=table.device)
        padding = torch.zeros((len(group), 1, 1, width), dtype=torch.bool, device=table.device)
        for n, i in enumerate(group):
            start, length = starts[i], lengths[i]
            slots[n, :length] = table[rows[i], start : start + length]
            slots[n, length:] = slots[n, length - 1]
            padding[n, ..., length:] = True
        head_major = bool(head_major_heads) and len(group) == 1
        if head_major:
            slots = head_major_index(slots, head_major_heads)
        consecutive = group == list(range(group[0], group[0] + len(group)))
        chunks.append(
            DecodeChunk(
                rows=slice(group[0], group[0] + len(group))
                if consecutive
                else torch.tensor(group, device=table.device),
                index=slots.view(-1),
                head_major=head_major,
                count=len(group),
                width=width,
                padding=padding if lengths[group[0]] != width else None,
            )
        )
    return chunks
