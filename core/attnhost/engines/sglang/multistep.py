"""SGLang's multi-step draft-decode container over attnhost adapters: one adapter per draft step.

SGLang's EAGLE and STANDALONE draft workers ask ``DraftBackendFactory.create_decode_backend`` for an
object whose ``attn_backends[i]`` serves draft step ``i`` and whose ``init_forward_metadata`` plans every
step once per round, before the steps run (``TritonMultiStepDraftBackend`` is the model: the worker then
enters each child's forward context in turn and rewrites ``forward_batch.out_cache_loc`` per step).

Each step is a DECODE batch of ``batch_size * topk`` *branch rows*. Row ``(b, t)`` attends to request
``b``'s committed prefix and to its own branch's draft tokens so far: the round's ``out_cache_loc`` is laid
out ``[batch_size, topk, num_steps]`` (``per_step_draft_out_cache_loc``), so branch ``t``'s token ``j`` is
at ``[b, t, j]``. One slot table per round (``batches.slot_table``) holds every row's prefix and branch
slots, and step ``i`` reads the first ``seq_len + i + 1`` of its row: to the attnhost backend it is a
plain decode batch whose rows happen to share prefix slots. With ``topk == 1`` a row is its request.

SGLang's draft-decode graphs (``EAGLEDraftCudaGraphRunner``) call the container's graph methods: the round's
table and every step's batch then live in buffers allocated once (``graphs.DraftGraphs``), refreshed in place
before each replay, so the captured steps read this round's slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from attnhost.engines.sglang.adapter import SGLangAdapterBackend
from attnhost.engines.sglang.batches import host_ints, slot_table
from attnhost.engines.sglang.graphs import DraftGraphs
from attnhost.errors import InvalidBatchError

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch

__all__ = ["SGLangMultiStepDraftBackend"]


class SGLangMultiStepDraftBackend:
    """The per-step draft-decode backends of one SGLang draft runner, planned together once per round."""

    needs_cpu_seq_lens = True  # the adapters read SGLang's host copies of an extend's or a decode's lengths

    def __init__(
        self, model_runner: Any, topk: int, speculative_num_steps: int, build: Callable[[], SGLangAdapterBackend]
    ) -> None:
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.attn_backends: list[SGLangAdapterBackend] = [build() for _ in range(speculative_num_steps - 1)]
        self._graphs: DraftGraphs | None = None  # the draft's decode graphs, once EAGLEDraftCudaGraphRunner asks
        self.prefill_attention_backend_str: str | None = None  # SGLang's DraftBackendFactory stamps these
        self.decode_attention_backend_str: str | None = None

    def init_forward_metadata(self, forward_batch: SGLangBatch) -> None:
        """Plan every draft step of this round from the round's batch (prefix lengths, write slots)."""
        if forward_batch.forward_mode.is_idle():
            for backend in self.attn_backends:
                backend.init_forward_metadata(forward_batch)
            return
        first = self.attn_backends[0]
        rows = self._check_round(forward_batch)
        # The committed prefixes are the device's, never read here: SGLang's host copy, where it has one, bounds them
        bs, steps = forward_batch.batch_size, self.speculative_num_steps
        width = int(self.req_to_token_pool.req_to_token.shape[1])
        host = forward_batch.seq_lens_cpu
        bounds = (width - steps,) * bs if host is None else tuple(min(n, width - steps) for n in host_ints(host))
        per_row = forward_batch.out_cache_loc.view(rows, -1)[:, :steps]  # a planned wider window leads with ours
        first.batches.check(
            forward_batch, forward_batch.seq_lens, bounds, (steps,) * bs, False, (0,) * bs, per_row.reshape(-1)
        )
        row_bounds = tuple(n for n in bounds for _ in range(self.topk))
        prefix = torch.repeat_interleave(forward_batch.seq_lens.to(torch.int64), self.topk)
        table = slot_table(
            self.req_to_token_pool.req_to_token,
            torch.repeat_interleave(forward_batch.req_pool_indices, self.topk),
            prefix,
            row_bounds,
            (steps,) * rows,
            per_row.reshape(-1),
        )
        for step, backend in enumerate(self.attn_backends):
            backend.plan_draft_step(forward_batch, table, prefix, row_bounds, per_row[:, step], step)

    def _check_round(self, forward_batch: SGLangBatch) -> int:
        """The round's write slots cover its branch rows' steps, laid out for this container's ``topk``: the
        number of branch rows."""
        first = self.attn_backends[0]
        rows = int(forward_batch.batch_size) * self.topk
        loc = forward_batch.out_cache_loc
        if loc.numel() % rows or loc.numel() // rows < self.speculative_num_steps:
            raise first.refuse(
                f"a draft round whose {loc.numel()} write slots do not cover {rows} branch rows x "
                f"{self.speculative_num_steps} steps",
                "report this to attnhost's maintainers",
            )
        carried = getattr(forward_batch.spec_info, "topk_p", None)  # [batch, topk]: the round's own breadth
        if carried is not None and carried.dim() == 2 and carried.shape[1] != self.topk:
            raise InvalidBatchError(
                f"{first.identity.where}: a draft round laid out for topk {carried.shape[1]} reached the multi-step "
                f"container built for topk {self.topk}, so each step's K/V would land in another step's slots; "
                f"nothing was read or written — {first.identity.engine_bug}"
            )
        return rows

    # -- graphs (EAGLEDraftCudaGraphRunner; graphs.DraftGraphs, docs/graphs.md) ------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The round's buffers for the largest captured batch, and each step's backend told the largest graph."""
        max_rows = max_bs * self.topk
        for backend in self.attn_backends:
            backend.start_graphs(max_rows, max_rows)
        kvs = [backend.kv_view for backend in self.attn_backends]
        table = self.req_to_token_pool.req_to_token
        self._graphs = DraftGraphs(kvs, table, max_bs, self.topk, self.speculative_num_steps, table.device)

    def init_forward_metadata_out_graph(self, forward_batch: SGLangBatch, in_capture: bool = False) -> None:
        """Before a draft round's capture and before every replay (SGLang pads the round to the captured size:
        request row 0, the fill length, write slot 0): the round into the buffers and every step planned on its
        graph batch, the same objects every round."""
        graphs = self._graphs
        first = self.attn_backends[0]
        where, engine_bug = first.identity.where, first.identity.engine_bug
        if graphs is None:
            raise RuntimeError(f"{where}: a draft graph step before SGLang called init_cuda_graph_state")
        if not graphs.covers(forward_batch.batch_size):
            raise RuntimeError(
                f"{where}: a draft graph of batch size {forward_batch.batch_size} beyond the {graphs.max_bs} "
                f"SGLang declared in init_cuda_graph_state; {engine_bug}"
            )
        table = graphs.rows.table_of(self._check_round(forward_batch))
        for backend in self.attn_backends:  # the steps' batches name the rows of this table
            backend.kv_view.slot_table = table
        batches = graphs.refresh(where, forward_batch, first.batches.num_slots, engine_bug)
        for backend, batch in zip(self.attn_backends, batches, strict=True):
            backend.plan_graph_step(forward_batch, batch)

    def init_forward_metadata_in_graph(self, forward_batch: SGLangBatch) -> None:
        """Nothing: every tensor the steps read was refreshed in place out of the graph."""
