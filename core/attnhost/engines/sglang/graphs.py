"""SGLang's decode graphs over an attnhost backend that declares graph support (docs/graphs.md).

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
"""

from __future__ import annotations

from typing import Any

import torch

from attnhost.engines.batch_checks import check_device_batch
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache

__all__ = ["SEQ_LEN_FILL", "DecodeGraphs"]

SEQ_LEN_FILL = 1
"""The length SGLang gives a padded row (``get_cuda_graph_seq_len_fill_value``): one key, slot 0's."""


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
        cached = vars(batch).get("page_table")
        if cached is not None:  # a backend reads the batch's page table (built at its first use): refreshed in place
            size = self.kv.page_size
            table = self.kv.req_to_token.index_select(0, self.rows[:bs])
            cached.copy_(table[:, : cached.shape[1] * size : size]).floor_divide_(size)
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
        )
