"""SGLang's graphs over an attnhost backend that declares graph support: decode, target verify, draft decode.

SGLang runs decode steps inside captured graphs: CUDA graphs (``DecodeCudaGraphRunner``: ``init_cuda_graph_state``
once, then per captured size ``init_forward_metadata_out_graph(batch, in_capture=True)`` before capture and
``init_forward_metadata_out_graph(view)`` before every replay) and, on CPUs, ``torch.compile`` graphs
(``CPUGraphRunner``: ``init_cpu_graph_state`` once, ``init_forward_metadata_capture_cpu_graph`` per size, then
``init_forward_metadata`` on every batch it runs, padded or not). Either way the attention the graph runs reads
its inputs by address (a CUDA graph) or by object (``torch.compile``'s guards), so this module owns one set of
buffers, allocated once for the largest captured batch, and one attnhost ``ForwardBatch`` per batch size over
them: every step copies SGLang's lengths, request rows and write slots into the buffers in place (four small
copies, no host read) and hands the backend the same batch object, which it re-plans in place.

The host lengths of a graph batch are bounds, the request table's width, the same at capture and at every replay
(the exact ones change on the device between replays); padded rows are SGLang's (request row 0, whose table row
is all slot 0, a length of :data:`SEQ_LEN_FILL`, write slot 0, the slot SGLang's allocators never hand out).

Speculative steps read their keys through a slot table of their own (``batches.slot_table``): the target's
verify graphs (``DecodeCudaGraphRunner`` in TARGET_VERIFY, each request's ``draft_token_num`` new tokens, a tree's
mask refreshed with the rest) and the draft's multi-step decode graphs (``EAGLEDraftCudaGraphRunner``, one batch
per step over branch rows) keep that table in a buffer too, refilled in place on the device from the committed
lengths, the request rows and the write slots: :class:`VerifyGraphs` and :class:`DraftGraphs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from attnhost.engines.batch_checks import check_device_batch
from attnhost.errors import InvalidBatchError
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache

__all__ = ["SEQ_LEN_FILL", "DecodeGraphs", "DraftGraphs", "VerifyGraphs"]

SEQ_LEN_FILL = 1
"""The length SGLang gives a padded row (``get_cuda_graph_seq_len_fill_value``): one key, slot 0's."""


def page_buffer(req_to_token: torch.Tensor, rows: int, page_size: int) -> torch.Tensor:
    """A graph's page table (``ForwardBatch.pages``) for ``rows`` rows as wide as the request table: allocated once."""
    width = -(-int(req_to_token.shape[1]) // page_size)
    return torch.zeros((rows, width), dtype=torch.int64, device=req_to_token.device)


def refresh_pages(pages: torch.Tensor, table: torch.Tensor, page_size: int) -> None:
    """The step's pages from its slot table (row ``i``'s every ``page_size``-th slot, over ``page_size``), in
    place: a backend that reads ``ForwardBatch.page_table`` in a captured step reads this step's pages."""
    pages.copy_(table[:, ::page_size]).floor_divide_(page_size)


class DecodeGraphs:
    """The buffers of one adapter's decode graphs and the attnhost batch of each captured size over them."""

    def __init__(self, kv: KVCache, max_bs: int, table_shape: tuple[int, int], device: torch.device) -> None:
        self.kv = kv
        self.max_bs = max_bs
        self.table_shape = table_shape
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL, dtype=torch.int64, device=device)
        self.prefix_lens = self.seq_lens - 1
        self.extend_lens = torch.ones((max_bs,), dtype=torch.int64, device=device)
        self.rows = torch.zeros((max_bs,), dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros((max_bs,), dtype=torch.int64, device=device)
        self.pages = page_buffer(kv.req_to_token, max_bs, kv.page_size)
        self.batches: dict[int, ForwardBatch] = {}

    def covers(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs

    def refresh(self, where: str, forward_batch: Any, num_slots: int, way_out: str) -> ForwardBatch:
        """SGLang's decode batch (a captured batch, a replay view, or a live batch a graph will run) copied into the
        buffers, checked there on the device, and the attnhost batch of its size, the same object every step."""
        bs = int(forward_batch.batch_size)
        loc = forward_batch.out_cache_loc
        live = loc.shape[0]  # a CUDA replay view carries the live rows' slots only: the rest are padding
        self.seq_lens[:bs].copy_(forward_batch.seq_lens[:bs])
        self.rows[:bs].copy_(forward_batch.req_pool_indices[:bs])
        self.out_cache_loc[:live].copy_(loc)
        self.out_cache_loc[live:bs].zero_()
        torch.sub(self.seq_lens[:bs], 1, out=self.prefix_lens[:bs])
        width = self.table_shape[1]
        check_device_batch(
            where,
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.rows[:bs],
            host_seq_lens=(width,) * bs,
            host_lengths_exact=False,
            extend_lens=(1,) * bs,
            num_slots=num_slots,
            num_rows=self.table_shape[0],
            way_out=way_out,
            padding_slot=0,
        )
        batch = self.batches.get(bs)
        if batch is None:
            batch = self.batches[bs] = self._batch(bs)
        refresh_pages(self.pages[:bs], self.kv.req_to_token.index_select(0, self.rows[:bs]), self.kv.page_size)
        return batch

    def _batch(self, bs: int) -> ForwardBatch:
        width = self.table_shape[1]
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            kv_pool=self.kv,
            req_pool_indices=self.rows[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_seq_lens=self.extend_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=(width,) * bs,
            prefix_lens_cpu=(width - 1,) * bs,
            extend_seq_lens_cpu=(1,) * bs,
            host_lengths_exact=False,
            pages=self.pages[:bs],
        )


class _TableRows:
    """Buffers for graph batches whose row ``r`` reads row ``r`` of a slot table of the graph's own: its request's
    committed prefix from SGLang's ``req_to_token``, then its ``new`` write slots, refilled in place on the device."""

    def __init__(self, req_to_token: torch.Tensor, max_rows: int, new: int, device: torch.device) -> None:
        self.req_to_token, self.max_rows, self.new = req_to_token, max_rows, new
        self.width = int(req_to_token.shape[1])
        self.committed = torch.full((max_rows,), SEQ_LEN_FILL, dtype=torch.int64, device=device)
        self.requests = torch.zeros((max_rows,), dtype=torch.int64, device=device)  # rows of req_to_token
        self.slots = torch.zeros((max_rows, new), dtype=torch.int64, device=device)
        self.table = torch.zeros((max_rows, self.width), dtype=req_to_token.dtype, device=device)
        self.row_of = torch.arange(max_rows, device=device).repeat_interleave(new)  # a new token's row
        self.step_of = torch.arange(new, device=device).repeat(max_rows)  # and its place among the row's new ones
        self.rows = torch.arange(max_rows, dtype=torch.int64, device=device)  # the batch's rows: the table's
        self.tables: dict[int, torch.Tensor] = {}

    def table_of(self, rows: int) -> torch.Tensor:
        """The table of a batch of ``rows`` rows: the same tensor object at capture and at every replay."""
        table = self.tables.get(rows)
        if table is None:
            table = self.tables[rows] = self.table[:rows]
        return table

    def check(
        self,
        where: str,
        committed: torch.Tensor,
        slots: torch.Tensor,
        requests: torch.Tensor,
        num_slots: int,
        way_out: str,
    ) -> None:
        """A round's committed lengths (within the table, ``new`` columns left), write slots (padding on slot 0) and
        request rows, on the device (``check_device_batch``: no read unless it fails)."""
        check_device_batch(
            where,
            seq_lens=committed,
            out_cache_loc=slots,
            req_pool_indices=requests,
            host_seq_lens=(self.width - self.new,) * committed.numel(),
            host_lengths_exact=False,
            extend_lens=(0,) * committed.numel(),
            num_slots=num_slots,
            num_rows=self.req_to_token.shape[0],
            way_out=way_out,
            padding_slot=0,
        )

    def fill_table(self, rows: int) -> None:
        """Each row's prefix slots, then its new tokens' slots at ``committed + j``: a gather and a scatter."""
        torch.index_select(self.req_to_token, 0, self.requests[:rows], out=self.table[:rows])
        tokens = rows * self.new
        row_of = self.row_of[:tokens]
        cols = self.committed.index_select(0, row_of) + self.step_of[:tokens]
        self.table.index_put_((row_of, cols), self.slots[:rows].reshape(-1).to(self.table.dtype))


class VerifyGraphs:
    """The buffers of one adapter's target-verify graphs (each request's ``draft_tokens`` new tokens after its
    committed prefix, as a chain or as a tree) and the attnhost batch of each captured size over them."""

    def __init__(
        self, kv: KVCache, req_to_token: torch.Tensor, max_bs: int, draft_tokens: int, tree: bool, device: torch.device
    ) -> None:
        self.kv, self.max_bs, self.draft_tokens = kv, max_bs, draft_tokens
        self.rows = _TableRows(req_to_token, max_bs, draft_tokens, device)
        self.seq_lens = self.rows.committed + draft_tokens
        self.extend_lens = torch.full((max_bs,), draft_tokens, dtype=torch.int64, device=device)
        n = draft_tokens
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril_().reshape(-1)
        self.causal = causal.repeat(max_bs)  # what a padded row's block holds (a chain of its own)
        self.tree_mask = self.causal.clone() if tree else None
        self.pages = page_buffer(req_to_token, max_bs, kv.page_size)
        self.batches: dict[int, ForwardBatch] = {}

    def covers(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs

    def refresh(
        self, where: str, forward_batch: Any, blocks: Any, num_slots: int, way_out: str, in_capture: bool
    ) -> ForwardBatch:
        """SGLang's verify batch (captured, or a replay view whose ``out_cache_loc`` holds the live requests' new
        tokens only) into the buffers, checked on the device, and the batch of its size, the same object every
        step. ``blocks(custom_mask, committed)``: the live requests' tree blocks (``batches.tree_blocks``'s layout),
        read from SGLang's mask at a replay; a capture's mask is SGLang's scratch buffer, never read."""
        bs, n, rows = int(forward_batch.batch_size), self.draft_tokens, self.rows
        loc = forward_batch.out_cache_loc
        if loc.numel() % n or loc.numel() // n > bs:
            raise InvalidBatchError(
                f"{where}: a verify graph batch of {bs} requests of {n} draft tokens with {loc.numel()} write slots; "
                f"nothing was read or written — {way_out}"
            )
        live = loc.numel() // n
        rows.committed[:bs].copy_(forward_batch.seq_lens[:bs])
        rows.requests[:bs].copy_(forward_batch.req_pool_indices[:bs])
        flat = rows.slots.view(-1)
        flat[: live * n].copy_(loc)
        flat[live * n : bs * n].zero_()
        torch.add(rows.committed[:bs], n, out=self.seq_lens[:bs])
        rows.check(where, rows.committed[:bs], flat[: bs * n], rows.requests[:bs], num_slots, way_out)
        rows.fill_table(bs)
        if self.tree_mask is not None:
            cells = n * n
            mask = getattr(getattr(forward_batch, "spec_info", None), "custom_mask", None)
            if in_capture or mask is None or not live:
                self.tree_mask[: bs * cells].copy_(self.causal[: bs * cells])
            else:
                self.tree_mask[: live * cells].copy_(blocks(mask, rows.committed[:live]))
                self.tree_mask[live * cells : bs * cells].copy_(self.causal[live * cells : bs * cells])
        batch = self.batches.get(bs)
        if batch is None:
            batch = self.batches[bs] = self._batch(bs)
        refresh_pages(self.pages[:bs], rows.table[:bs], self.kv.page_size)
        return batch

    def _batch(self, bs: int) -> ForwardBatch:
        n, width = self.draft_tokens, self.rows.width
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            kv_pool=self.kv,
            req_pool_indices=self.rows.rows[:bs],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.rows.committed[:bs],
            extend_seq_lens=self.extend_lens[:bs],
            out_cache_loc=self.rows.slots[:bs].view(-1),
            seq_lens_cpu=(width,) * bs,
            prefix_lens_cpu=(width - n,) * bs,
            extend_seq_lens_cpu=(n,) * bs,
            tree_mask=None if self.tree_mask is None else self.tree_mask[: bs * n * n],
            host_lengths_exact=False,
            pages=self.pages[:bs],
        )


class DraftGraphs:
    """The buffers of one draft runner's multi-step decode graphs: ``topk`` branch rows per request, ``steps``
    write slots per row (``multistep``'s layout), and one attnhost decode batch per captured size and step."""

    def __init__(
        self,
        kvs: Sequence[KVCache],
        req_to_token: torch.Tensor,
        max_bs: int,
        topk: int,
        steps: int,
        device: torch.device,
    ) -> None:
        """``kvs``: each step's KV view (the step's adapter's), whose batches read this graph's slot table."""
        self.kvs, self.max_bs, self.topk, self.steps = kvs, max_bs, topk, steps
        max_rows = max_bs * topk
        self.rows = _TableRows(req_to_token, max_rows, steps, device)
        self.offsets = torch.arange(steps, dtype=torch.int64, device=device).view(steps, 1)
        self.prefix_lens = torch.zeros((steps, max_rows), dtype=torch.int64, device=device)  # step i: committed + i
        self.seq_lens = self.prefix_lens + 1
        self.step_slots = torch.zeros((steps, max_rows), dtype=torch.int64, device=device)
        self.ones = torch.ones((max_rows,), dtype=torch.int64, device=device)
        self.page_size = kvs[0].page_size
        self.pages = page_buffer(req_to_token, max_rows, self.page_size)  # one table: every step reads it
        self.batches: dict[tuple[int, int], ForwardBatch] = {}

    def covers(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs

    def refresh(self, where: str, forward_batch: Any, num_slots: int, way_out: str) -> list[ForwardBatch]:
        """SGLang's draft round (captured, or padded to a captured size) into the buffers, checked on the device,
        and each step's batch of its size: the same objects every round."""
        bs, topk, steps, rows = int(forward_batch.batch_size), self.topk, self.steps, self.rows
        count = bs * topk
        loc = forward_batch.out_cache_loc
        if loc.numel() % count or loc.numel() // count < steps:
            raise InvalidBatchError(
                f"{where}: a draft graph round whose {loc.numel()} write slots do not cover {count} branch rows x "
                f"{steps} steps; nothing was read or written — {way_out}"
            )
        per_row = loc.view(count, -1)[:, :steps]  # a planned wider window leads with ours
        committed, requests = forward_batch.seq_lens[:bs], forward_batch.req_pool_indices[:bs]
        rows.check(where, committed, per_row.reshape(-1), requests, num_slots, way_out)
        rows.committed[:count].view(bs, topk).copy_(committed.view(bs, 1).expand(bs, topk))
        rows.requests[:count].view(bs, topk).copy_(requests.view(bs, 1).expand(bs, topk))
        rows.slots[:count].copy_(per_row)
        rows.fill_table(count)
        torch.add(rows.committed[:count].view(1, count), self.offsets, out=self.prefix_lens[:, :count])
        torch.add(self.prefix_lens[:, :count], 1, out=self.seq_lens[:, :count])
        self.step_slots[:, :count].copy_(per_row.t())
        refresh_pages(self.pages[:count], rows.table[:count], self.page_size)
        return [self._batch(bs, step) for step in range(steps - 1)]

    def _batch(self, bs: int, step: int) -> ForwardBatch:
        batch = self.batches.get((bs, step))
        if batch is None:
            count, prefix = bs * self.topk, self.rows.width - self.steps + step
            batch = self.batches[bs, step] = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                kv_pool=self.kvs[step],
                req_pool_indices=self.rows.rows[:count],
                seq_lens=self.seq_lens[step, :count],
                prefix_lens=self.prefix_lens[step, :count],
                extend_seq_lens=self.ones[:count],
                out_cache_loc=self.step_slots[step, :count],
                seq_lens_cpu=(prefix + 1,) * count,
                prefix_lens_cpu=(prefix,) * count,
                extend_seq_lens_cpu=(1,) * count,
                host_lengths_exact=False,
                pages=self.pages[:count],
            )
        return batch
