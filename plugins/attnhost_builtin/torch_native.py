"""SGLang's ``torch_native`` backend: causal attention with PyTorch's SDPA over the KV cache.

Per-batch work (``init_forward_metadata``) decides, once, how each request's
keys are read and which mask it needs; per-layer work is then the cache write
and SDPA calls: one per decode chunk, one per extend request.  Three measured
choices shape the code:

* The cache is token-major (``[slot, kv_head, dim]``).  An extending request
  whose slots form one ascending run is read through a zero-copy view; only
  fragmented requests pay for a gather, and on several threads a request
  gathered alone is gathered head-major (``_head_rows``), the way SDPA then
  splits it between threads.
* Decode batches are attended in chunks, not request by request: each
  chunk's key rows are gathered with one ``index_select`` (requests sorted
  by length and padded, the padding masked) and attended with one batched
  SDPA call.  A per-request loop pays a kernel launch, a thread-pool wake-up
  and a poorly parallel SDPA (one request has only ``kv_heads`` units of
  work) for every request of every layer; on fragmented slots that, not the
  gather, dominated (BENCHMARKS.md, "SGLang bridge").
* For GQA/MQA the ``group`` query heads that share a KV head are folded into
  the query-length axis (``[kv_heads, group * tokens, dim]``), so SDPA sees a
  plain multi-head problem.  On CPU ``enable_gqa=True`` falls back to a slow
  path for few queries, so folding wins for decode and short extends and
  never loses for long ones (BENCHMARKS.md).  The one exception is a long
  prefill without prefix: there ``is_causal=True`` avoids materialising a
  ``group * tokens * tokens`` mask at the same speed.

A speculative tree (``ForwardBatch.tree_mask``) changes only which mask a
request gets: its prefix columns all visible, then its own block of the tree
mask. It is built once per batch with the causal masks, so a tree verify costs
per layer what a chain verify of the same size costs (BENCHMARKS.md). A tree
row that is all False in a request without a prefix leaves its query no key;
the contract gives it zeros, which SDPA does not promise for a row that may
attend nowhere (older releases gave NaN), so the plan finds those rows once
and the layers zero them.

Layers with an attention variant (docs/variants.md: a sliding window, a
soft-cap, sinks, non-causal) are planned the same way, once per batch, in
``torch_native_variants.py``; decode keeps its chunks, each request's row
cut to the window. Plain layers take exactly the path above.

It declares no graph support (``BackendCapabilities.cuda_graph``), as SGLang
switches graphs off for its own ``torch_native``: every choice above (a view
or a gather, which requests share a decode chunk, the masks' sizes) is made
from the requests' slots and exact lengths read on the host, once per batch.
That is what makes it fast eagerly, and what a captured step cannot do
(docs/graphs.md); the engines run it without graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attnhost.backend import FLOAT_DTYPES, FP8_KV_DTYPES, AttentionBackend, AttentionLayer, BackendCapabilities
from attnhost_builtin import torch_native_mla, torch_native_variants
from attnhost_builtin.shapes import check_rows

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost.backend import AttentionRunner
    from attnhost.forward_batch import ForwardBatch

__all__ = ["TorchNativeAttnBackend"]

# Above this many query rows a prefix-free request uses is_causal + enable_gqa
# instead of a folded, masked call (same speed, no mask memory).
_CAUSAL_MIN_TOKENS = 256
# Largest folded mask (elements) worth materialising; beyond it the unfolded
# [tokens, seq] mask with enable_gqa costs the same compute and less memory.
_MAX_FOLDED_MASK = 1 << 25
# Bytes of K and V one decode chunk gathers: small enough that the gathered rows are still in cache when
# SDPA reads them, large enough that a chunk holds several requests of a small model (BENCHMARKS.md,
# "What made it fast"). A request larger than this is a chunk alone.
_DECODE_CHUNK_BYTES = 8 << 20


@dataclass(slots=True)
class _RequestPlan:
    """How one request is attended: its rows in ``q``, its keys, its mask."""

    q_start: int
    q_len: int
    prefix_len: int
    seq_len: int
    kv_run: tuple[int, int] | None  # contiguous slot range, read as a view
    kv_index: torch.Tensor | None  # gather indices when the slots are fragmented
    tree: torch.Tensor | None = None
    """``[q_len, q_len]`` bool: which of its new tokens each new token sees (a speculative tree); None: causal."""
    blind: torch.Tensor | None = None
    """``[q_len, 1, 1]`` bool, True for a new token that sees no key (a tree row all False, no prefix): its
    output is zeros. None (nearly always): every token sees a key."""
    head_index: dict[int, torch.Tensor] = field(default_factory=dict)
    """``kv_index`` as head-major rows (``_head_rows``), by KV head count; built on the first layer."""
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # by GQA group size
    recipes: dict[int, tuple[bool, bool, torch.Tensor | None]] = field(default_factory=dict)
    """(folds, is_causal, mask) by GQA group size: decided on the first layer, reused by the rest."""
    variants: dict[tuple[int, bool, int, int], torch_native_variants.Recipe] = field(default_factory=dict)
    """How layers with an attention variant attend this request (torch_native_variants.py), by
    (window, causal, query heads, GQA group): decided on the first such layer, reused by the rest."""

    def keys(self, buffer: torch.Tensor, rows: torch.Tensor | None, scratch: torch.Tensor | None) -> torch.Tensor:
        """This request's ``[seq_len, kv_heads, dim]`` rows of a cache buffer (``rows``: its ``_head_rows``).

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
            index = self.head_index[heads] = _head_major(self.kv_index.view(1, -1), heads)
        return _gather_head_major(rows, index, out, heads, self.seq_len)[0].transpose(0, 1)

    def uses_is_causal(self, group: int) -> bool:
        """Whether SDPA's top-left ``is_causal`` is exact here (square, no prefix) and cheaper."""
        return (
            self.prefix_len == 0
            and self.tree is None
            and self.q_len > 1
            and (group == 1 or self.q_len >= _CAUSAL_MIN_TOKENS or not self._fold_fits(group))
        )

    def folds(self, group: int) -> bool:
        return group > 1 and not self.uses_is_causal(group) and self._fold_fits(group)

    def _fold_fits(self, group: int) -> bool:
        return self.q_len <= 1 or group * self.q_len * self.seq_len <= _MAX_FOLDED_MASK

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
class _DecodeChunk:
    """Decode requests attended by one SDPA call: where they sit in the batch, their padded key slots."""

    rows: slice | torch.Tensor  # the requests' positions in the batch: a slice when consecutive
    index: torch.Tensor
    """What one ``index_select`` gathers: ``[count, width]`` slots (a shorter request repeats its last slot),
    or, when ``head_major``, one request's ``[kv_heads, width]`` rows of the cache viewed as
    ``[slot * kv_heads + head, dim]`` (see ``_head_rows``)."""
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
class _BatchPlan:
    batch: ForwardBatch
    requests: list[_RequestPlan]
    decode_table: tuple[torch.Tensor, list[int]] | None = None
    """Set when every request brings one token (unless one request reads a view): the slot table and the
    requests' rows in it, from which the decode chunks are planned."""
    longest_gather: int = 0
    """Rows of the longest fragmented request (0: nothing is gathered); sizes the extend scratch."""
    head_major: bool = field(default_factory=lambda: torch.get_num_threads() > 1)
    """Whether lone requests are gathered head-major (``_head_rows``): it pays only when SDPA splits a
    request between threads; on one thread the token-major gather's longer row copies are cheaper."""
    scratch: dict[tuple[int, torch.dtype, torch.device, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    """Gather targets for fragmented requests, by (K or V, dtype, device, row shape)."""
    chunks: dict[tuple[int, int, bool, int], tuple[list[_DecodeChunk], int]] = field(default_factory=dict)
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

    def decode_chunks(self, buffer: torch.Tensor, head_major: bool, window: int = -1) -> tuple[list[_DecodeChunk], int]:
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
            chunks = _decode_chunks(table, rows, self.requests, key[1], heads if head_major else 0, window)
            planned = self.chunks[key] = (chunks, max(chunk.count * chunk.width for chunk in chunks))
        return planned


class TorchNativeAttnBackend(AttentionBackend):
    """Reference-quality attention on any device torch runs on; SGLang's ``torch_native``."""

    # Every path views q itself anyway, so SGLang's [T, heads * dim] layout costs nothing extra.
    # An FP8 cache is dequantised where its rows change dtype anyway; pages are read through req_to_token.
    capabilities = BackendCapabilities(
        kv_cache_dtypes=(*FLOAT_DTYPES, *FP8_KV_DTYPES),
        flat_heads=True,
        tree_mask=True,
        mla=True,
        sliding_window=True,
        logit_cap=True,
        sinks=True,
        non_causal=True,
    )

    def __init__(self, runner: AttentionRunner | None = None) -> None:
        super().__init__(runner)
        self._plan: _BatchPlan | None = None
        self._mha_checked: ForwardBatch | None = None  # the last batch the MLA MHA form accepted

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Resolve every request's key slots once, so layers only slice and call SDPA."""
        table = forward_batch.kv_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        plans, largest = [], (-1, -1, -1, -1)
        for i, (row, q_start, prefix, extend) in enumerate(
            zip(
                rows,
                forward_batch.extend_start_loc_cpu,
                forward_batch.prefix_lens_cpu,
                forward_batch.extend_seq_lens_cpu,
                strict=True,
            )
        ):
            plan, (high, position) = _plan_request(table[row], q_start, prefix, extend, (i, row))
            plans.append(plan)
            if high > largest[0]:
                largest = (high, i, row, position)
        if forward_batch.tree_mask is not None:
            _plan_trees(plans, forward_batch.tree_mask)
        lone_view = len(plans) == 1 and plans[0].kv_run is not None  # nothing to gather: a view is cheaper
        if plans and not lone_view and all(plan.q_len == 1 and plan.tree is None for plan in plans):
            self._plan = _BatchPlan(forward_batch, plans, (table, rows), largest=largest)
        else:
            longest = max((plan.seq_len for plan in plans if plan.kv_run is None), default=0)
            self._plan = _BatchPlan(forward_batch, plans, None, longest, largest=largest)

    def forward_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        sinks: Tensor | None = None,
    ) -> Tensor:
        plan = self._plan_for(forward_batch)
        pool = forward_batch.kv_pool
        tokens, lid = forward_batch.num_new_tokens, layer.layer_id
        check_rows("q", q, tokens, layer.num_heads, layer.head_dim, lid)
        if save_kv_cache:
            check_rows("k", k, tokens, layer.num_kv_heads, layer.head_dim, lid)
            check_rows("v", v, tokens, layer.num_kv_heads, layer.head_dim, lid)
        plan.check_reads(min(pool.k_buffer(lid).shape[0], pool.v_buffer(lid).shape[0]), lid)
        if save_kv_cache:
            if k.dim() != 3:  # accepted flat, as SGLang's own backends accept them
                k, v = (t.view(-1, layer.num_kv_heads, layer.head_dim) for t in (k, v))
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        flat = q.dim() == 2  # [T, heads * dim] in, the same out (capabilities.flat_heads)
        k_buffer, v_buffer = pool.k_buffer(layer.layer_id), pool.v_buffer(layer.layer_id)
        if layer.has_sinks or sinks is not None:
            torch_native_variants.check_sinks(layer, sinks)
        if plan.decode_table is not None:
            return _decode(q, k_buffer, v_buffer, plan, layer, flat, sinks)
        if flat:
            q = q.view(-1, layer.num_heads, layer.head_dim)
        if layer.sliding_window_size >= 0 or not layer.is_causal or layer.logit_cap > 0.0 or sinks is not None:
            out = torch_native_variants.attend(plan, q, k_buffer, v_buffer, layer, sinks)
            return out.view(-1, layer.num_heads * layer.head_dim) if flat else out
        gathers = plan.longest_gather and plan.head_major
        k_rows, v_rows = (_head_rows(k_buffer), _head_rows(v_buffer)) if gathers else (None, None)
        if len(plan.requests) == 1:
            # SDPA's CPU flash kernel already lays its output out token-major,
            # so a lone request needs no copy into an output buffer.
            req = plan.requests[0]
            keys, values = req.keys(k_buffer, k_rows, None), req.keys(v_buffer, v_rows, None)
            out = _attend_request(q, keys, values, layer, req)
            return out.reshape(-1, layer.num_heads * layer.head_dim) if flat else out.contiguous()
        k_scratch, v_scratch = plan.gather_scratch(k_buffer, 0), plan.gather_scratch(v_buffer, 1)
        # Requests are laid out in order in q, so their outputs are concatenated once at the
        # end (one kernel) rather than copied into an output tensor one by one. SDPA's
        # outputs are fresh tensors, so reusing the gather scratch for the next request is safe.
        out = torch.cat(
            [
                _attend_request(
                    q[req.q_start : req.q_start + req.q_len],
                    req.keys(k_buffer, k_rows, k_scratch),
                    req.keys(v_buffer, v_rows, v_scratch),
                    layer,
                    req,
                )
                for req in plan.requests
            ]
        )
        return out.view(-1, layer.num_heads * layer.head_dim) if flat else out

    def forward_mla_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        """MLA's MHA form (torch_native_mla.py); its batch is checked on the first layer only."""
        plan = self._plan_for(forward_batch)
        if self._mha_checked is not forward_batch:
            torch_native_mla.check_mha_batch(forward_batch)
            self._mha_checked = forward_batch
        return torch_native_mla.forward_mha(plan, q, k, v, layer)

    def forward_mla_mqa(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        q_rope: Tensor | None = None,
        k_rope: Tensor | None = None,
    ) -> Tensor:
        """MLA's absorbed form, every forward mode (torch_native_mla.py)."""
        plan = self._plan_for(forward_batch)
        plan.check_reads(forward_batch.kv_pool.k_buffer(layer.layer_id).shape[0], layer.layer_id)
        return torch_native_mla.forward_mqa(plan, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def _plan_for(self, forward_batch: ForwardBatch) -> _BatchPlan:
        plan = self._plan
        if plan is None or plan.batch is not forward_batch:
            raise RuntimeError(
                "TorchNativeAttnBackend: init_forward_metadata() was not called for this "
                "ForwardBatch; call it once per batch before the layers run"
            )
        return plan


def _plan_request(
    slots_row: torch.Tensor, q_start: int, prefix: int, extend: int, where: tuple[int, int]
) -> tuple[_RequestPlan, tuple[int, int]]:
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
    return _RequestPlan(
        q_start=q_start,
        q_len=extend,
        prefix_len=prefix,
        seq_len=seq_len,
        kv_run=(first, first + seq_len) if contiguous else None,
        kv_index=None if contiguous else slots.clone(),
    ), (high, int(torch.argmax(slots)))


def _plan_trees(plans: list[_RequestPlan], tree_mask: torch.Tensor) -> None:
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
    plans: list[_RequestPlan],
    row_bytes: int,
    head_major_heads: int,
    window: int = -1,
) -> list[_DecodeChunk]:
    """Group a decode batch's requests into chunks of similar length, each gathered and attended at once.

    Sorting by length keeps the padding small when lengths differ; a chunk
    closes when its padded K and V rows would pass ``_DECODE_CHUNK_BYTES``.
    Given ``head_major_heads``, a chunk of one request indexes one head's
    row at a time (see ``_head_rows``). With a sliding ``window`` (``>= 0``)
    a request's row holds only its last ``window + 1`` slots: the keys its
    query sees, so a windowed decode reads the window, not the whole cache.
    """
    starts = [max(0, plan.seq_len - window - 1) if window >= 0 else 0 for plan in plans]
    lengths = [plan.seq_len - start for plan, start in zip(plans, starts, strict=True)]
    order = sorted(range(len(plans)), key=lambda i: lengths[i])
    groups: list[list[int]] = [[]]
    for i in order:
        group = groups[-1]
        if group and 2 * (len(group) + 1) * lengths[i] * row_bytes > _DECODE_CHUNK_BYTES:
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
            slots = _head_major(slots, head_major_heads)
        consecutive = group == list(range(group[0], group[0] + len(group)))
        chunks.append(
            _DecodeChunk(
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


def _head_major(slots: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n, width]`` slots as the ``[n, heads, width]`` row numbers of ``_head_rows``, flattened."""
    per_head = torch.arange(heads, dtype=torch.int64, device=slots.device).view(1, -1, 1)
    return (slots.to(torch.int64).unsqueeze(1) * heads + per_head).view(-1)


def _head_rows(buffer: torch.Tensor) -> torch.Tensor | None:
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


def _gather_head_major(
    rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None, heads: int, width: int
) -> torch.Tensor:
    """``index`` (from ``_head_major``) gathered from ``rows`` (``_head_rows``) into ``out`` (any shape of the
    right size), as ``[requests, heads, width, dim]``: each head's keys contiguous, as SDPA reads them."""
    dim = rows.shape[1]
    gathered = torch.index_select(rows, 0, index, out=None if out is None else out.view(-1, dim))
    return gathered.view(-1, heads, width, dim)


def _decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: _BatchPlan,
    layer: AttentionLayer,
    flat: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: one query per request and every key visible, so a chunk is one gather and one SDPA call.

    The queries are viewed GQA-folded (``[requests, kv_heads, q_per_kv,
    dim]``, q's own memory order, from either of its layouts), so SDPA sees
    a plain multi-head problem whose batch is the chunk's requests. A window
    only shortens each request's gathered row (``_decode_chunks``); one query
    sees its request's every key whether the layer is causal or not; a
    soft-cap or sinks take the explicit softmax instead of SDPA.
    """
    kv_heads, dim = layer.num_kv_heads, layer.head_dim
    shape = (-1, layer.num_heads * dim) if flat else (-1, layer.num_heads, dim)
    queries = q.view(-1, kv_heads, layer.num_heads // kv_heads, dim)
    k_rows, v_rows = (_head_rows(k_buffer), _head_rows(v_buffer)) if plan.head_major else (None, None)
    chunks, most = plan.decode_chunks(k_buffer, k_rows is not None and v_rows is not None, layer.sliding_window_size)
    k_scratch, v_scratch = plan.gather_scratch(k_buffer, 0, most), plan.gather_scratch(v_buffer, 1, most)
    assert k_scratch is not None and v_scratch is not None
    convert = k_buffer.dtype != q.dtype
    explicit = layer.logit_cap > 0.0 or sinks is not None
    sink_rows = None if sinks is None else torch_native_variants.sink_rows(sinks, kv_heads, 1, q.dtype)
    out = None if len(chunks) == 1 and isinstance(chunks[0].rows, slice) else torch.empty_like(queries)
    for chunk in chunks:
        count, width = chunk.count, chunk.width
        k_out, v_out = k_scratch[: count * width], v_scratch[: count * width]
        if chunk.head_major:
            assert k_rows is not None and v_rows is not None
            keys = _gather_head_major(k_rows, chunk.index, k_out, kv_heads, width)
            values = _gather_head_major(v_rows, chunk.index, v_out, kv_heads, width)
        else:
            keys = torch.index_select(k_buffer, 0, chunk.index, out=k_out)
            values = torch.index_select(v_buffer, 0, chunk.index, out=v_out)
            keys = keys.view(count, width, kv_heads, dim).transpose(1, 2)
            values = values.view(count, width, kv_heads, dim).transpose(1, 2)
        if convert:
            keys = torch_native_variants.kv_as(keys, q.dtype, layer.k_scale)
            values = torch_native_variants.kv_as(values, q.dtype, layer.v_scale)
        mine = queries[chunk.rows] if isinstance(chunk.rows, slice) else queries.index_select(0, chunk.rows)
        if explicit:
            work = torch_native_variants.work_dtype(q.dtype)
            o = torch_native_variants.explicit_attention(
                mine, keys, values, chunk.mask(work), layer.scaling, layer.logit_cap, sink_rows
            )
        else:
            o = F.scaled_dot_product_attention(mine, keys, values, attn_mask=chunk.mask(q.dtype), scale=layer.scaling)
        if out is None:
            return o.view(shape)
        if isinstance(chunk.rows, slice):
            out[chunk.rows] = o
        else:
            out.index_copy_(0, chunk.rows, o)
    assert out is not None
    return out.view(shape)


def _attend_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    req: _RequestPlan,
) -> torch.Tensor:
    """SDPA for one request: ``q`` ``[tokens, heads, dim]``, ``k``/``v`` ``[seq, kv_heads, dim]``; a token that
    sees no key (``req.blind``) gets zeros.

    Inputs are given SDPA as 4-D ``[1, heads, len, dim]`` views: on CPU only
    4-D inputs reach the fused flash kernel; 3-D ones take the slower math
    path.
    """
    out = _sdpa_request(q, k, v, layer, req)
    return out if req.blind is None else out.masked_fill(req.blind, 0.0)


def _sdpa_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    req: _RequestPlan,
) -> torch.Tensor:
    """:func:`_attend_request`'s SDPA call, in the layout that is fastest for the request."""
    group = layer.num_heads // layer.num_kv_heads
    k_h, v_h = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # views
    if k_h.dtype != q.dtype:
        k_h, v_h = (
            torch_native_variants.kv_as(k_h, q.dtype, layer.k_scale),
            torch_native_variants.kv_as(v_h, q.dtype, layer.v_scale),
        )
    folds, is_causal, mask = req.recipe(group, q.device)
    if folds and req.q_len == 1:
        # One query token (decode): the folded [kv_heads, group, dim] layout is q's own memory
        # order (head = kv_head * group + g), so a view replaces the transpose-and-copy below.
        o = F.scaled_dot_product_attention(
            q.reshape(1, layer.num_kv_heads, group, layer.head_dim), k_h, v_h, attn_mask=mask, scale=layer.scaling
        )
        return o.reshape(1, layer.num_heads, layer.head_dim)
    q_h = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim]
    if folds:
        folded = q_h.reshape(1, layer.num_kv_heads, group * req.q_len, layer.head_dim)
        o = F.scaled_dot_product_attention(folded, k_h, v_h, attn_mask=mask, scale=layer.scaling)
        return o.reshape(layer.num_heads, req.q_len, layer.head_dim).transpose(0, 1)
    o = F.scaled_dot_product_attention(
        q_h,
        k_h,
        v_h,
        attn_mask=mask,
        is_causal=is_causal,
        scale=layer.scaling,
        enable_gqa=group > 1,
    )
    return o[0].transpose(0, 1)
