"""The conformance kit's graph cases: a backend that declares ``cuda_graph`` captured and replayed as the engines do.

What a declaration of ``BackendCapabilities.cuda_graph`` promises (docs/graphs.md) is checked here on a CPU, the
way SGLang's graph runners use a backend: a decode batch of ``graph_batch_size`` rows over buffers allocated once
(``init_graph_state`` first), planned at capture with every row padding, then replayed with 1 to all of its rows
live, the rest padded SGLang's way (request row 0, whose table row is all slot 0; a length of 1; write slot 0).
Between replays the buffers are refilled in place and the backend re-plans the same batch object.

* Replayed eagerly with every tensor an engine keeps on its device refusing host reads
  (:mod:`attnhost.testing.host_reads`): a backend that reads a length, a slot or a mask on the host fails,
  naming the read.
* Replayed through ``torch.compile(fullgraph=True)``: the layers' forward must trace as one graph, compile once
  and, like a CUDA graph, read every tensor at the address it had at capture; a backend that plans into fresh
  tensors each step fails naming the graph input that moved.
* Either way the live rows equal float64 attention over their requests' keys, their K/V lands in their slots,
  and no slot but slot 0 changes for a padded row.

Hand-written on ``torch._dynamo``'s backend hook because no library checks CUDA-graph pointer stability without
a GPU: the hook sees every tensor the traced step reads, by the attribute it came from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from attnhost.backend import AttentionBackend, AttentionLayer
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.kv_pool import KVPool
from attnhost.runner import ModelRunner
from attnhost.testing.harness import ConformanceHarness, fail, stored
from attnhost.testing.host_reads import HostReadError, device_only, no_host_reads
from attnhost.testing.reference import reference_attention

__all__ = ["GraphConformance"]

PREFIXES = (9, 4, 13, 6)
"""The cached prefixes of the graph's requests (each replay adds one token to every live one)."""
LIVE_COUNTS = (3, 1, 4, 2)
"""Live requests at each replay: fewer than captured (padding), one, all of them, and back."""


@dataclass
class _Graph:
    """One captured decode graph: its buffers, the batch over them and the step's inputs, all allocated once."""

    runner: ModelRunner
    requests: list[int]
    prefixes: list[int]
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    rows: torch.Tensor
    out_cache_loc: torch.Tensor
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    batch: ForwardBatch

    @property
    def pool(self) -> KVPool:
        return self.runner.kv_pool

    @property
    def backend(self) -> AttentionBackend:
        return self.runner.attn_backend


class _StableInputs:
    """A ``torch.compile`` backend that runs the traced graph as it is and, like a CUDA graph, requires every tensor
    it reads at each call to be where it was when the graph was captured."""

    def __init__(self) -> None:
        self.compilations = 0
        self.moved: list[str] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.compilations += 1
        names = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
        captured = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in example_inputs]

        def replay(*args: Any) -> Any:
            for name, address, now in zip(names, captured, args, strict=False):
                if address is not None and isinstance(now, torch.Tensor) and now.data_ptr() != address:
                    self.moved.append(name)
            return graph(*args)

        return replay


class GraphConformance(ConformanceHarness):
    """The graph cases, run for a backend that declares ``cuda_graph`` and skipped, in one sentence, for others."""

    graph_batch_size: ClassVar[int] = 4
    """Rows of the captured graph (SGLang captures sizes 1, 2, 4, 8, ...)."""

    def test_graph_replays_read_nothing_on_the_host(self) -> None:
        graph = self._capture(refuse_reads=True)
        for step, live in enumerate(LIVE_COUNTS, start=1):
            self._replay(graph, live, step, f"graph replay {step} ({live} of {self.graph_batch_size} rows live)")

    def test_graph_step_compiles_whole_and_keeps_its_storage(self) -> None:
        graph = self._capture(refuse_reads=False)
        recorder = _StableInputs()
        torch._dynamo.reset()
        try:
            compiled = torch.compile(self._step, backend=recorder, fullgraph=True, dynamic=False)
            try:  # the capture: the step compiled on the batch as planned at capture, every row padding
                with no_host_reads(), torch.no_grad(), graph.runner.forward_context():
                    compiled(graph)
            except Exception as exc:
                raise AssertionError(
                    f"graph capture: torch.compile(fullgraph=True) of the layers' forward raised "
                    f"{type(exc).__name__}: {exc}; a captured step must trace as one graph (no graph break)"
                ) from exc
            for step, live in enumerate(LIVE_COUNTS, start=1):
                what = f"compiled graph replay {step} ({live} of {self.graph_batch_size} rows live)"
                self._replay(graph, live, step, what, compiled)
                if recorder.moved:
                    fail(
                        f"{what}: the step read {', '.join(sorted(set(recorder.moved)))} at another address than at "
                        "capture; a CUDA graph would read the old one: allocate the backend's metadata once "
                        "(init_graph_state, or the batch's first plan) and refresh it in place when "
                        "init_forward_metadata gets the same batch again"
                    )
            if recorder.compilations != 1:
                fail(
                    f"the graph step was compiled {recorder.compilations} times, not once: something it reads on "
                    "the host changed between replays (a replay must see the same batch object and the same host "
                    "values; only tensor contents change)"
                )
        finally:
            torch._dynamo.reset()

    # -- capture and replay ---------------------------------------------------------

    def _require_graphs(self) -> None:
        if not self._capabilities().cuda_graph:
            pytest.skip(
                f"backend {self.name!r} does not declare cuda_graph (BackendCapabilities.cuda_graph): engines run "
                "it without graphs"
            )

    def _capture(self, *, refuse_reads: bool) -> _Graph:
        """A runner whose request row 0 and slot 0 are nobody's (SGLang's padding), the graph's requests with their
        prefixes cached, and the decode graph planned at capture with every row padding."""
        self._require_graphs()
        n = self.graph_batch_size
        runner = self._runner()
        pool = runner.kv_pool
        padding_row, padding_slot = runner.new_request(), pool.alloc_slots(1)
        if padding_row != 0 or int(padding_slot[0]) != 0:  # pragma: no cover - a fresh pool hands these out first
            fail("the kit's pool did not reserve request row 0 and slot 0 for padding")
        requests = [runner.new_request() for _ in range(n)]
        prefixes = [PREFIXES[i % len(PREFIXES)] + i // len(PREFIXES) for i in range(n)]
        prefill = ForwardBatch.prepare(pool, ForwardMode.EXTEND, list(zip(requests, [0] * n, prefixes, strict=True)))
        for layer in runner.layers:
            k = self._randn(prefill.num_new_tokens, layer.num_kv_heads, layer.head_dim, dtype=runner.dtype)
            v = self._randn(prefill.num_new_tokens, layer.num_kv_heads, layer.head_dim, dtype=runner.dtype)
            pool.set_kv(layer.layer_id, prefill.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        width = pool.max_context_len
        make = device_only if refuse_reads else _as_is
        if refuse_reads:
            pool.req_to_token = device_only(pool.req_to_token)
        seq_lens = make(torch.ones(n, dtype=torch.int64, device=self.device))
        prefix_lens = make(torch.zeros(n, dtype=torch.int64, device=self.device))
        rows = make(torch.zeros(n, dtype=torch.int64, device=self.device))
        out_cache_loc = make(torch.zeros(n, dtype=torch.int64, device=self.device))

        def zeros(heads: int, dim: int) -> torch.Tensor:
            return make(torch.zeros(n, heads, dim, dtype=runner.dtype, device=self.device))

        inputs = [
            (
                zeros(layer.num_heads, layer.head_dim),
                zeros(layer.num_kv_heads, layer.head_dim),
                zeros(layer.num_kv_heads, layer.head_dim),
            )
            for layer in runner.layers
        ]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            kv_pool=pool,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_seq_lens=make(torch.ones(n, dtype=torch.int64, device=self.device)),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=(width,) * n,
            prefix_lens_cpu=(width - 1,) * n,
            extend_seq_lens_cpu=(1,) * n,
            host_lengths_exact=False,
        )
        graph = _Graph(runner, requests, prefixes, seq_lens, prefix_lens, rows, out_cache_loc, inputs, batch)
        backend = graph.backend
        try:
            with no_host_reads():
                backend.init_graph_state(n, n, width)
                backend.init_forward_metadata(batch)
                with torch.no_grad(), runner.forward_context():
                    self._step(graph)  # the warm-up run before capture: every row padding
        except HostReadError as exc:
            fail(f"graph capture (every row padding): {exc}")
        except Exception as exc:
            raise AssertionError(
                f"graph capture (every row padding) raised {type(exc).__name__}: {exc}; a backend that declares "
                "cuda_graph plans a batch whose host lengths are bounds (host_lengths_exact=False)"
            ) from exc
        return graph

    @staticmethod
    def _step(graph: _Graph) -> list[torch.Tensor]:
        """The captured part: every layer's forward over the graph's inputs."""
        return [
            graph.backend.forward(q, k, v, layer, graph.batch)
            for layer, (q, k, v) in zip(graph.runner.layers, graph.inputs, strict=True)
        ]

    def _replay(
        self, graph: _Graph, live: int, step: int, what: str, compiled: Callable[[_Graph], Any] | None = None
    ) -> None:
        """Refill the buffers with ``live`` requests, one new token each (the rest padding), re-plan the same batch,
        run the step, and check the live rows, their K/V and every other slot."""
        pool, runner = graph.pool, graph.runner
        slots = pool.alloc_slots(live)
        for i in range(self.graph_batch_size):
            if i < live:
                request, prefix = graph.requests[i], graph.prefixes[i]
                pool.req_to_token[request, prefix] = slots[i]  # the engine records the new token's slot first
                values = (prefix + 1, request, int(slots[i]))
            else:
                values = (1, 0, 0)  # SGLang's padding: length 1, request row 0, slot 0
            for buffer, value in zip((graph.seq_lens, graph.rows, graph.out_cache_loc), values, strict=True):
                buffer[i] = value
        torch.sub(graph.seq_lens, 1, out=graph.prefix_lens)
        for q, k, v in graph.inputs:
            for tensor in (q, k, v):
                tensor.copy_(self._randn(*tensor.shape, dtype=tensor.dtype))
        before = [
            (pool.k_buffer(layer.layer_id).clone(), pool.v_buffer(layer.layer_id).clone()) for layer in runner.layers
        ]
        try:
            with no_host_reads(), torch.no_grad(), runner.forward_context():
                graph.backend.init_forward_metadata(graph.batch)
                outs = compiled(graph) if compiled is not None else self._step(graph)
        except HostReadError as exc:
            fail(f"{what}: {exc}")
        except Exception as exc:
            raise AssertionError(f"{what}: the step raised {type(exc).__name__}: {exc}") from exc
        exact = ForwardBatch.from_lists(
            pool, ForwardMode.DECODE, [(graph.requests[i], graph.prefixes[i], 1) for i in range(live)], slots
        )
        for layer, out, (q, k, v), (k_before, v_before) in zip(runner.layers, outs, graph.inputs, before, strict=True):
            self._check_graph_layer(what, layer, exact, out, (q, k, v), (k_before, v_before), live)
        for i in range(live):
            graph.prefixes[i] += 1

    def _check_graph_layer(
        self,
        what: str,
        layer: AttentionLayer,
        exact: ForwardBatch,
        out: torch.Tensor,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        before: tuple[torch.Tensor, torch.Tensor],
        live: int,
    ) -> None:
        pool = exact.kv_pool
        q, k, v = (t.as_subclass(torch.Tensor) for t in inputs)
        slots = exact.out_cache_loc
        for name, buffer, old, new, scale in (
            ("K", pool.k_buffer(layer.layer_id), before[0], k, layer.k_scale),
            ("V", pool.v_buffer(layer.layer_id), before[1], v, layer.v_scale),
        ):
            buffer = buffer.as_subclass(torch.Tensor)
            want = stored(new[:live], scale, buffer.dtype)
            if not torch.equal(buffer[slots].view(torch.uint8), want.view(torch.uint8)):
                fail(f"{what}, layer {layer.layer_id}: a live row's new {name} is not at its write slot")
            changed = (buffer != old).flatten(1).any(dim=1)
            changed[slots] = False
            changed[0] = False  # the padded rows' slot
            if bool(changed.any()):
                slot = int(changed.nonzero()[0, 0])
                fail(
                    f"{what}, layer {layer.layer_id}: slot {slot} changed, but no live row writes it; a padded row "
                    "(request row 0, length 1, write slot 0) may write slot 0 only"
                )
        got = out.as_subclass(torch.Tensor).reshape(self.graph_batch_size, layer.num_heads, layer.head_dim)
        if not bool(torch.isfinite(got).all()):
            fail(f"{what}, layer {layer.layer_id}: an output row is not finite (a padded row must compute harmlessly)")
        reference = reference_attention(q[:live], layer, exact)
        error = float((got[:live].to("cpu", torch.float64) - reference).abs().max())
        atol = self._atol(q.dtype)
        if not error <= atol:
            fail(f"{what}, layer {layer.layer_id}: the live rows' max abs error {error:.1e} exceeds {atol:.0e}")


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
