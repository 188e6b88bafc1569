"""What SGLang's graph runners ask of one adapter: its graphs' buffers once, then the host part of every step.

SGLang's ``DecodeCudaGraphRunner`` calls ``init_cuda_graph_state`` once and ``init_forward_metadata_out_graph``
before each capture and replay; its ``CPUGraphRunner`` calls ``init_cpu_graph_state`` once and then plans every
decode batch it runs through ``init_forward_metadata``. The adapter keeps those methods (SGLang calls them by name)
and hands their work to :class:`GraphSteps`: which graphs it captures (decode and target verify; the draft's decode
graphs are the multi-step container's), the buffers of each (``graphs``), and the step's attnhost batch, the same
object every step of its size, for the adapter to plan. Graphs are refused, naming the way out, for a backend that
does not declare ``cuda_graph``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnhost.engines.sglang.graphs import SEQ_LEN_FILL, DecodeGraphs, VerifyGraphs

if TYPE_CHECKING:
    from attnhost.engines.identity import BackendIdentity
    from attnhost.engines.sglang.batches import SGLangBatches
    from attnhost.errors import UnsupportedFeatureError
    from attnhost.forward_batch import ForwardBatch

__all__ = ["GraphSteps"]


class GraphSteps:
    """One adapter's decode and target-verify graphs, once a graph runner asks for them."""

    def __init__(self, batches: SGLangBatches) -> None:
        self.batches = batches
        self.decode: DecodeGraphs | None = None
        """The decode graphs' buffers, from ``init_cuda_graph_state`` (or the CPU graph runner's) on."""
        self.verify: VerifyGraphs | None = None
        """The target-verify graphs' buffers, from their first capture on (the draft-token count comes with it)."""
        self.cpu = False
        """The CPU graph runner's graphs: it plans every decode batch it runs eagerly (``init_forward_metadata``)."""

    @property
    def identity(self) -> BackendIdentity:
        """The adapter's backend, as its batch translation names it."""
        return self.batches.identity

    def refuse(self) -> UnsupportedFeatureError:
        return self.identity.refuse(
            "graph capture (it declares no cuda_graph capability)", "run SGLang with --disable-cuda-graph"
        )

    def allocate(self, max_bs: int, cpu: bool) -> None:
        """The decode graphs' buffers, for the largest captured batch; a verify graph's come at its first capture."""
        kv = self.batches.kv
        self.decode = DecodeGraphs(kv, max_bs, self.batches.table_shape, kv.device)
        self.verify = None
        self.cpu = cpu

    def seq_len_fill(self) -> int:
        """The length SGLang gives a padded row of a captured batch."""
        if not self.identity.capabilities.cuda_graph:
            raise self.refuse()
        return SEQ_LEN_FILL

    def cpu_decode(self, forward_batch: Any) -> ForwardBatch | None:
        """A decode batch the CPU graph runner runs compiled, in its graph's buffers; ``None`` for one it runs
        eagerly (no CPU graphs, or a batch larger than the largest captured)."""
        graphs = self.decode if self.cpu else None
        if graphs is None or not graphs.covers(forward_batch.batch_size):
            return None
        self.batches.kv.slot_table = None
        return graphs.refresh(self.identity.where, forward_batch, self.batches.num_slots, self.identity.engine_bug)

    def step(self, forward_batch: Any, in_capture: bool) -> ForwardBatch:
        """The host part of a graph step, before capture and before every replay: SGLang's batch (or its replay
        view) into the graph's buffers, checked, and the attnhost batch of its size. The graph itself then holds
        only the layers' forward. Decode and target-verify graphs (``DecodeCudaGraphRunner`` captures one or the
        other)."""
        identity, kv, engine_bug = self.identity, self.batches.kv, self.identity.engine_bug
        graphs = self.decode
        if graphs is None:
            raise (
                self.refuse()
                if not identity.capabilities.cuda_graph
                else RuntimeError(f"{identity.where}: a graph step before SGLang called init_cuda_graph_state")
            )
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_target_verify()):
            raise identity.refuse(
                f"{mode.name} graphs (decode and target-verify graphs run through this adapter, draft-decode ones "
                "through its multi-step container)",
                "run SGLang with --disable-cuda-graph",
            )
        if not graphs.covers(forward_batch.batch_size):
            raise RuntimeError(
                f"{identity.where}: a graph of batch size {forward_batch.batch_size} beyond the {graphs.max_bs} "
                f"SGLang declared in init_cuda_graph_state; {engine_bug}"
            )
        kv.take_mark(forward_batch)
        if mode.is_decode():
            kv.slot_table = None
            return graphs.refresh(identity.where, forward_batch, self.batches.num_slots, engine_bug)
        verify = self.verify
        if verify is None:
            if not in_capture:
                raise RuntimeError(f"{identity.where}: a target-verify graph replayed before its capture; {engine_bug}")
            verify = self.verify = self._new_verify(forward_batch.spec_info, graphs.max_bs)
        kv.slot_table = verify.rows.table_of(forward_batch.batch_size)  # what the batch's rows name
        return verify.refresh(
            identity.where,
            forward_batch,
            lambda mask, committed: self.batches.blocks(mask, committed, verify.draft_tokens),
            self.batches.num_slots,
            engine_bug,
            in_capture,
        )

    def _new_verify(self, spec_info: Any, max_bs: int) -> VerifyGraphs:
        """The verify graphs' buffers for the verify input SGLang captures with: its draft-token count, and a tree
        mask where its steps may carry a tree (an EAGLE tree, or a verify input without ``topk`` whose mask only
        a read could tell a chain: a graph cannot read it, so it hands the backend the mask whatever it holds)."""
        refuse = self.identity.refuse
        draft_tokens = int(getattr(spec_info, "draft_token_num", 0) or 0)
        if draft_tokens < 1:
            raise refuse("a target-verify batch without draft_token_num (not an EAGLE verify input)")
        topk = getattr(spec_info, "topk", None)
        tree = getattr(spec_info, "custom_mask", None) is not None and topk != 1
        if tree and not self.identity.capabilities.tree_mask:
            raise refuse(
                "speculative tree verify (this batch's custom_mask is a tree; it declares no tree_mask capability)"
                if topk is not None
                else f"target-verify graphs over {type(spec_info).__name__}'s custom masks (a graph cannot read a "
                "mask to tell a chain; it declares no tree_mask capability)",
                "run chains (--speculative-eagle-topk 1), SGLang with --disable-cuda-graph, or a backend that "
                "declares tree_mask",
            )
        kv = self.batches.kv
        return VerifyGraphs(kv, kv.request_table, max_bs, draft_tokens, tree, kv.device)
