"""Attention overhead: one layer's forward through a runner's ``torch_native`` backend vs bare SDPA.

The baseline is, exactly, *the same ``scaled_dot_product_attention`` calls the
backend makes, on the same tensors, without the runner/backend layer*: one
forward is run with SDPA wrapped to record every call's arguments, and the
baseline replays those recorded calls. Whatever the backend does around
SDPA is therefore the measured overhead: writing the new K/V into the cache,
slicing or gathering each request's keys, folding GQA heads, the mode
dispatch and the forward context, assembling the output.

For a *paged* layout SDPA cannot be called on the cache at all: any
SDPA-based attention must first gather each request's scattered K/V rows into
a dense tensor. There the baseline is "per request, one ``index_select`` of K
and of V from the cache into the very tensors its recorded SDPA call reads,
then that call" — the least work a direct implementation does. (Replaying the
SDPA calls alone would read tensors the gathers just left hot in cache without
paying for the gathers, which flatters neither side honestly.)

Per-batch planning (``init_forward_metadata``, once per forward for all
layers) is not in the per-layer figure; it is reported in the notes.

Shapes: 32 query heads, 8 KV heads, head_dim 128, float32, CPU. "contiguous"
means each request's slots form one ascending run (read as a view); "paged"
means the decode token's slot was allocated after every prefix, as a paged
allocator does mid-generation (a request's keys are then gathered).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from _common import Row, interleaved, per_call

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _cases(quick: bool) -> list[tuple[str, str, int, int, int, bool]]:
    """(label, mode, requests, prefix, new tokens, contiguous)."""
    cases = [
        ("extend 1x2048 (prefill)", "extend", 1, 0, 2048, True),
        ("extend 4x128 on 896 prefix (chunked)", "extend", 4, 896, 128, True),
        ("decode 16x1024, contiguous", "decode", 16, 1023, 1, True),
        ("decode 16x1024, paged", "decode", 16, 1023, 1, False),
    ]
    if not quick:
        cases.insert(1, ("extend 1x512 (prefill)", "extend", 1, 0, 512, True))
        cases.append(("decode 64x256, paged", "decode", 64, 255, 1, False))
    return cases


def _setup(mode: str, n_req: int, prefix: int, new: int, contiguous: bool) -> tuple[Any, ...]:
    import torch

    from attnhost import ForwardBatch, ForwardMode, ModelRunner, ServerArgs

    torch.manual_seed(0)
    seq = prefix + new
    runner = ModelRunner(
        ServerArgs(attention_backend="torch_native"),
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_requests=n_req,
        max_context_len=seq,
        num_slots=n_req * seq,
    )
    pool = runner.kv_pool
    requests = [runner.new_request() for _ in range(n_req)]
    forward_mode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    if contiguous:
        # Each request takes its whole run at once; the forward then covers its last `new` tokens.
        runner.prepare_batch(ForwardMode.EXTEND, [(r, 0, seq) for r in requests])
        loc = torch.cat([pool.req_to_token[r, prefix:seq] for r in requests])
        batch = ForwardBatch.from_lists(pool, forward_mode, [(r, prefix, new) for r in requests], loc)
    else:
        if prefix:
            runner.prepare_batch(ForwardMode.EXTEND, [(r, 0, prefix) for r in requests])
        batch = ForwardBatch.prepare(pool, forward_mode, [(r, prefix, new) for r in requests])
    pool.k_buffer(0).normal_()
    pool.v_buffer(0).normal_()
    start = time.perf_counter()
    runner.attn_backend.init_forward_metadata(batch)
    plan_seconds = time.perf_counter() - start
    n = batch.num_new_tokens
    q = torch.randn(n, HEADS * HEAD_DIM)
    k = torch.randn(n, KV_HEADS * HEAD_DIM)
    v = torch.randn(n, KV_HEADS * HEAD_DIM)
    return runner, batch, q, k, v, plan_seconds


def _record_sdpa(forward: Callable[[], object]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Run ``forward`` once with SDPA wrapped, returning every call's arguments."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        forward()
    finally:
        F.scaled_dot_product_attention = real
    return calls


def run(rounds: int, quick: bool, threads: int | None) -> list[Row]:
    import torch

    torch.set_grad_enabled(False)
    default_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(rounds, quick, torch.get_num_threads())
    finally:
        torch.set_num_threads(default_threads)


def _run(rounds: int, quick: bool, threads: int) -> list[Row]:
    rows: list[Row] = []
    for case in _cases(quick):
        rows += _measure(rounds, threads, *case)
    return rows


def _measure(
    rounds: int, threads: int, label: str, mode: str, n_req: int, prefix: int, new: int, contiguous: bool
) -> list[Row]:
    import torch
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    runner, batch, q, k, v, plan_seconds = _setup(mode, n_req, prefix, new, contiguous)
    backend, layer = runner.attn_backend, runner.layers[0]

    def through_runner() -> object:
        with runner.forward_context():
            return backend.forward(q, k, v, layer, batch)

    calls = _record_sdpa(through_runner)

    def direct() -> None:
        for args, kwargs in calls:
            sdpa(*args, **kwargs)

    gathers = _gathers_into_recorded_tensors(batch, layer.layer_id, calls)

    def gather_then_direct() -> None:
        # Per request, refill the very tensors its recorded SDPA call reads, then replay
        # that call: the minimal "gather + SDPA" a direct implementation over a paged cache does.
        for (args, kwargs), request_gathers in zip(calls, gathers, strict=True):
            for cache, index, out in request_gathers:
                torch.index_select(cache, 0, index, out=out)
            sdpa(*args, **kwargs)

    number = max(1, int(0.05 / _once(through_runner)))
    baseline = direct if contiguous else gather_then_direct
    candidates = {"runner": per_call(through_runner, number), "direct": per_call(baseline, number)}
    stats = interleaved(candidates, rounds)
    notes = [
        f"torch threads: {threads}; init_forward_metadata (once per batch, all layers): {plan_seconds * 1e6:.0f} us"
    ]

    sdpa_only = f"the same {len(calls)} SDPA call(s) on the same tensors"
    return [
        Row(
            section="attention overhead",
            case=label,
            candidate="runner torch_native forward (1 layer)",
            value=stats["runner"].median * 1e6,
            baseline=sdpa_only if contiguous else f"{n_req} K/V gathers from the paged cache + {sdpa_only}",
            baseline_value=stats["direct"].median * 1e6,
            unit="us",
            spread=stats["runner"].spread,
            baseline_spread=stats["direct"].spread,
            n=stats["runner"].n,
            target="ratio <= 1.05",
            max_ratio=1.05,
            notes=notes,
        )
    ]


def _gathers_into_recorded_tensors(
    batch: Any, layer_id: int, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
) -> list[list[tuple[Any, Any, Any]]]:
    """For each request, (cache, slot index, dense tensor its recorded SDPA call reads K or V from).

    The backend gathers a fragmented request's rows into a fresh dense tensor
    and hands SDPA a view of it; the view's ``_base`` is that tensor.
    """
    import torch

    pool = batch.kv_pool
    caches = (pool.k_buffer(layer_id), pool.v_buffer(layer_id))
    out: list[list[tuple[Any, Any, Any]]] = []
    requests = zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, strict=True)
    for (req, seq_len), (args, _) in zip(requests, calls, strict=True):
        index = pool.req_to_token[req, :seq_len].clone()
        request_gathers = []
        for cache, recorded in zip(caches, args[1:3], strict=True):
            dense = recorded._base if recorded._base is not None else recorded
            if isinstance(dense, torch.Tensor) and tuple(dense.shape) == (seq_len, *cache.shape[1:]):
                request_gathers.append((cache, index, dense))
        out.append(request_gathers)
    return out


def _once(fn: Callable[[], object]) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-6)
