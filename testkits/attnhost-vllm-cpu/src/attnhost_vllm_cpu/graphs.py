"""The layer kit's graph cases: a backend that declares ``cuda_graph`` captured and replayed as vLLM's GPU runner does.

vLLM asks a builder for its support level (``get_cudagraph_support``), then per captured size builds the capture's
metadata (``build_for_cudagraph_capture``: a uniform batch, every slot ``-1``, as its dummy run has it) and, at each
replay, the metadata of a live batch padded to that size its way: requests past the live ones without query
tokens (``query_start_loc`` repeats), of length 0, their block-table rows the null block; the padded tokens with slot
``-1``. The captured graph then reads that metadata, and the step's inputs, by address.

:func:`check_graph` runs one such graph: an eager warm-up run and the capture at :data:`GRAPH_REQUESTS` requests
(vLLM warms up eagerly before each capture), then replays with
:data:`LIVE` requests live (fewer, one, all, in another order each time), each replay with new tokens for its live
requests. Either eagerly with everything vLLM keeps on its device refusing host reads
(:mod:`attnhost.testing.host_reads`), or through ``torch.compile(fullgraph=True)`` with a backend hook that, like a
CUDA graph, requires every tensor the step reads to be where it was at capture. Each replay is then checked as
every other kit case is (:func:`attnhost_vllm_cpu.forward.problem`): the live rows against float64 attention,
their K/V at their slots, no other slot changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata

from attnhost.testing.host_reads import HostReadError, device_only, no_host_reads
from attnhost_vllm_cpu.forward import ATOL, problem
from attnhost_vllm_cpu.kit import NULL_BLOCK, PAD_SLOT, Case, make_case

__all__ = ["GRAPH_REQUESTS", "LIVE", "check_graph"]

PREFIXES = (9, 4, 13, 6)
"""The cached prefixes of the graph's requests."""
GRAPH_REQUESTS = len(PREFIXES)
LIVE: tuple[tuple[int, ...], ...] = ((2, 0, 3), (1,), (3, 1, 0, 2), (0, 2))
"""The live requests of each replay, in batch order: fewer than captured (padding), one, all, and back."""


class _StableInputs:
    """A ``torch.compile`` backend that runs the traced graph as it is and, like a CUDA graph, records every tensor
    it reads at another address than at capture."""

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


@dataclasses.dataclass
class _Step:
    """What the captured step reads: the layers' impls, caches, inputs and outputs, allocated once (vLLM copies each
    step's inputs into its persistent buffers)."""

    impls: list[Any]
    caches: list[torch.Tensor]
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    outputs: list[torch.Tensor]
    metadata: Any = None

    def run(self) -> list[torch.Tensor]:
        return [
            impl.forward(None, q, k, v, cache, self.metadata, output=out)
            for impl, cache, (q, k, v), out in zip(self.impls, self.caches, self.inputs, self.outputs, strict=True)
        ]


def check_graph(
    cls: type,
    what: str,
    *,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    query_len: int = 1,
    compiled: bool = False,
) -> None:
    """Capture and replay one graph of ``cls`` (module docstring); ``AssertionError`` with one line naming the
    replay and what broke."""
    n, q_len = GRAPH_REQUESTS, query_len
    case = make_case(
        [(p, q_len) for p in PREFIXES], block_size=block_size, num_heads=8, num_kv_heads=2, dtype=dtype, padding=0
    )
    spec = case.spec
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(len(case.caches))]
    builder = cls.get_builder_cls()(spec, layer_names, VllmConfig(cache_config=CacheConfig()), "cpu")  # type: ignore[attr-defined]
    support = builder.get_cudagraph_support(None, spec)
    if support.value < AttentionCGSupport.UNIFORM_BATCH.value:
        raise AssertionError(
            f"{what}: the builder reports {support.name}; a backend that declares cuda_graph "
            "captures uniform batches (UNIFORM_BATCH)"
        )
    make = (lambda t: t) if compiled else device_only
    width = case.metadata.block_table_tensor.shape[1]
    tokens = n * q_len

    def zeros(heads: int) -> torch.Tensor:
        return make(torch.zeros(tokens, heads, spec.head_size, dtype=dtype))

    step = _Step(
        impls=[_impl(cls, case) for _ in case.caches],
        caches=case.caches,
        inputs=[(zeros(case.num_heads), zeros(spec.num_kv_heads), zeros(spec.num_kv_heads)) for _ in case.caches],
        outputs=[torch.zeros(tokens, case.num_heads, spec.head_size, dtype=dtype) for _ in case.caches],
    )
    run: Callable[[], list[torch.Tensor]] = step.run
    recorder = _StableInputs()
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(step.run, backend=recorder, fullgraph=True, dynamic=False)
    capture = _padded(case, list(range(n)), n, q_len, width, slots=False)
    reads = contextlib.nullcontext if compiled else no_host_reads
    try:
        with reads():
            step.metadata = builder.build_for_cudagraph_capture(_on_device(capture, make))
        with torch.no_grad(), reads():
            step.run()  # vLLM's warm-up run before each capture, eager (the impls bind their caches here)
            run()  # the capture (compiled: traced and compiled here): every slot -1, nothing written
    except HostReadError as exc:
        raise AssertionError(f"{what}: graph capture: {exc}") from exc
    except Exception as exc:
        raise AssertionError(f"{what}: graph capture raised {type(exc).__name__}: {exc}") from exc
    captured = step.metadata.batch
    try:
        for replay, live in enumerate(LIVE, start=1):
            label = f"{what}: {'compiled ' if compiled else ''}graph replay {replay} ({len(live)} of {n} requests live)"
            _replay(case, step, builder, live, width, q_len, make, run, label, captured)
            if recorder.moved:
                raise AssertionError(
                    f"{label}: the step read {', '.join(sorted(set(recorder.moved)))} at another address than at "
                    "capture; a CUDA graph would read the old one: plan into buffers allocated once and refresh "
                    "them in place when init_forward_metadata gets the same batch again"
                )
        if compiled and recorder.compilations != 1:
            raise AssertionError(
                f"{what}: the graph step was compiled {recorder.compilations} times, not once: something it reads on "
                "the host changed between replays"
            )
    finally:
        if compiled:
            torch._dynamo.reset()


def _replay(
    case: Case,
    step: _Step,
    builder: Any,
    live: tuple[int, ...],
    width: int,
    q_len: int,
    make: Callable[[torch.Tensor], torch.Tensor],
    run: Callable[[], list[torch.Tensor]],
    label: str,
    captured: Any,
) -> None:
    """New tokens for the live requests, vLLM's padded metadata for them, the step, and the check."""
    n = GRAPH_REQUESTS
    gen = torch.Generator().manual_seed(len(live) * 31 + sum(live))
    for i in live:  # each live request's new tokens get new values (its prefix stays)
        r = case.requests[i]
        for layer in range(len(case.caches)):
            for values in (r.k[layer], r.v[layer]):
                values[r.prefix :] = torch.randn(values[r.prefix :].shape, generator=gen, dtype=torch.float64)
            r.q[layer] = torch.randn(r.q[layer].shape, generator=gen, dtype=torch.float64)
            for tensors in (r.k, r.v, r.q):
                tensors[layer] = tensors[layer].to(case.caches[0].dtype).to(torch.float64)
    sub = dataclasses.replace(case, requests=[case.requests[i] for i in live], padding=(n - len(live)) * q_len)
    for layer, (q, k, v) in enumerate(step.inputs):
        for buffer, new in zip((q, k, v), sub.layer_inputs(layer, q.dtype), strict=True):
            buffer.as_subclass(torch.Tensor).copy_(new)
    before = [cache.clone() for cache in case.caches]
    metadata = _padded(case, list(live), n, q_len, width, slots=True)
    try:
        with no_host_reads() if make is device_only else contextlib.nullcontext():
            step.metadata = builder.build(0, _on_device(metadata, make))
        if step.metadata.batch is not captured:
            raise AssertionError(
                f"{label}: the builder handed the backend another batch object than at capture; a replay must "
                "re-plan the captured batch in place"
            )
        with torch.no_grad(), no_host_reads() if make is device_only else contextlib.nullcontext():
            outputs = run()
    except HostReadError as exc:
        raise AssertionError(f"{label}: {exc}") from exc
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{label}: the step raised {type(exc).__name__}: {exc}") from exc
    found = problem(sub, [out.as_subclass(torch.Tensor) for out in outputs], before, ATOL[step.outputs[0].dtype])
    if found is not None:
        raise AssertionError(f"{label}: {found}")


def _padded(case: Case, live: list[int], n: int, q_len: int, width: int, *, slots: bool) -> CommonAttentionMetadata:
    """vLLM's metadata for ``live`` requests padded to ``n`` (``slots=False``: its capture, every slot ``-1``)."""
    bs = case.block_size
    reqs = [case.requests[i] for i in live]
    starts = [min(i, len(reqs)) * q_len for i in range(n + 1)]
    table = torch.full((n, width), NULL_BLOCK, dtype=torch.int32)
    for row, r in enumerate(reqs):
        table[row, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
    mapping = [r.blocks[p // bs] * bs + p % bs if slots else PAD_SLOT for r in reqs for p in range(r.prefix, r.seq)] + [
        PAD_SLOT
    ] * ((n - len(reqs)) * q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens = [r.seq for r in reqs] + [0] * (n - len(reqs))
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=n,
        num_actual_tokens=n * q_len,
        max_query_len=q_len,
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.tensor(mapping, dtype=torch.int64),
        causal=True,
    )


def _on_device(m: CommonAttentionMetadata, make: Callable[[torch.Tensor], torch.Tensor]) -> CommonAttentionMetadata:
    names = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
    return m.replace(**{name: make(getattr(m, name)) for name in names})


def _impl(cls: type, case: Case) -> Any:
    spec = case.spec
    return cls.get_impl_cls()(  # type: ignore[attr-defined]
        case.num_heads,
        spec.head_size,
        spec.head_size**-0.5,
        spec.num_kv_heads,
        None,
        None,
        "auto",
        None,
        AttentionType.DECODER,
        None,
    )
