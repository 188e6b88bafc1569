"""Attention overhead: one layer's forward through a runner's ``torch_native`` backend vs bare SDPA.

The baseline is, exactly, *the same ``scaled_dot_product_attention`` calls the
backend makes, on the same tensors, without the runner/backend layer*: one
forward is run with SDPA wrapped to record every call's arguments, and the
baseline replays those recorded calls. Whatever the backend does around
SDPA is therefore the measured overhead: writing the new K/V into the cache,
slicing each request's keys, folding GQA heads, the mode dispatch and the
forward context, assembling the output.

For a *paged* layout SDPA cannot be called on the cache at all: any
SDPA-based attention must first gather the scattered K/V rows into dense
tensors. So ``torch.index_select`` is recorded too, and the baseline replays
the same gathers and the same SDPA calls in the same order — the least work a
direct implementation does. (Replaying the SDPA calls alone would read tensors
the gathers just left hot in cache without paying for the gathers.)

Per-batch planning (``init_forward_metadata``, once per forward for all
layers) is not in the per-layer figure; it is reported in the notes.

Shapes: 32 query heads, 8 KV heads, head_dim 128, float32, CPU. "contiguous"
means each request's slots form one ascending run (read as a view); "paged"
means the decode token's slot was allocated after every prefix, as a paged
allocator does mid-generation (a request's keys are then gathered).

Speculative verify: ``torch_native``'s TARGET_VERIFY with a tree mask against
the same verify as a chain (causal), same requests, same draft-token count,
same slots (the draft tokens allocated after every prefix, as in a serving
engine), each through its own runner, interleaved. The tree is a complete
``topk``-ary tree over the draft tokens; the target is ratio <= 1.2.

Run alone: ``python benchmarks/bench_attention.py [--verify-only] [--rounds N] [--quick]``.
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


def _runner(n_req: int, seq: int) -> Any:
    """A one-layer torch_native runner whose cache holds ``n_req`` requests of ``seq`` tokens exactly."""
    from attnhost import ModelRunner, ServerArgs

    return ModelRunner(
        ServerArgs(attention_backend="torch_native"),
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_requests=n_req,
        max_context_len=seq,
        num_slots=n_req * seq,
    )


def _setup(mode: str, n_req: int, prefix: int, new: int, contiguous: bool) -> tuple[Any, ...]:
    import torch

    from attnhost import ForwardBatch, ForwardMode

    torch.manual_seed(0)
    seq = prefix + new
    runner = _runner(n_req, seq)
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


Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _record_kernels(forward: Callable[[], object]) -> list[Call]:
    """Run ``forward`` once with SDPA and ``torch.index_select`` wrapped; return every call, in order.

    ``index_select`` is how a backend gathers a paged request's K/V rows; the
    backend's own bookkeeping (slicing, views, dispatch, output assembly) is
    what the replay leaves out.
    """
    import torch
    import torch.nn.functional as F

    real_sdpa, real_select = F.scaled_dot_product_attention, torch.index_select
    calls: list[Call] = []

    def spy(real: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append((real, args, kwargs))
            return real(*args, **kwargs)

        return record

    F.scaled_dot_product_attention = spy(real_sdpa)
    torch.index_select = spy(real_select)  # type: ignore[assignment]
    try:
        forward()
    finally:
        F.scaled_dot_product_attention = real_sdpa
        torch.index_select = real_select
    return calls


def _verify_cases(quick: bool) -> list[tuple[str, int, int, int, int]]:
    """(label, requests, prefix, draft tokens, topk)."""
    cases = [
        ("verify 16x8 on 1016 prefix, topk 2", 16, 1016, 8, 2),
        ("verify 1x16 on 1008 prefix, topk 4", 1, 1008, 16, 4),
    ]
    if not quick:
        cases.append(("verify 4x64 on 960 prefix, topk 8", 4, 960, 64, 8))
    return cases


def _verify_setup(n_req: int, prefix: int, new: int, topk: int | None) -> tuple[Any, ...]:
    """A runner with ``n_req`` prefilled requests and a TARGET_VERIFY batch over them: a tree when ``topk``."""
    import torch

    from attnhost import ForwardMode

    torch.manual_seed(0)
    runner = _runner(n_req, prefix + new)
    requests = [runner.new_request() for _ in range(n_req)]
    runner.prepare_batch(ForwardMode.EXTEND, [(r, 0, prefix) for r in requests])
    runner.kv_pool.k_buffer(0).normal_()
    runner.kv_pool.v_buffer(0).normal_()
    tree_mask = None
    if topk is not None:  # a complete topk-ary tree: draft token i's parent is (i - 1) // topk
        block = torch.eye(new, dtype=torch.bool)
        for token in range(1, new):
            block[token] |= block[(token - 1) // topk]
        tree_mask = block.flatten().repeat(n_req)
    start = time.perf_counter()
    batch = runner.prepare_batch(ForwardMode.TARGET_VERIFY, [(r, prefix, new) for r in requests], tree_mask)
    plan_seconds = time.perf_counter() - start
    n = batch.num_new_tokens
    q = torch.randn(n, HEADS * HEAD_DIM)
    k = torch.randn(n, KV_HEADS * HEAD_DIM)
    v = torch.randn(n, KV_HEADS * HEAD_DIM)
    return runner, batch, q, k, v, plan_seconds


def _measure_verify(rounds: int, threads: int, label: str, n_req: int, prefix: int, new: int, topk: int) -> Row:
    forwards = {}
    plans = {}
    for kind, tree_topk in (("tree", topk), ("chain", None)):
        runner, batch, q, k, v, plans[kind] = _verify_setup(n_req, prefix, new, tree_topk)

        def forward(runner: Any = runner, batch: Any = batch, q: Any = q, k: Any = k, v: Any = v) -> object:
            with runner.forward_context():
                return runner.attn_backend.forward(q, k, v, runner.layers[0], batch)

        forwards[kind] = forward
    number = max(1, int(0.05 / _once(forwards["chain"])))
    stats = interleaved({kind: per_call(fn, number) for kind, fn in forwards.items()}, rounds)
    return Row(
        section="speculative verify",
        case=label,
        candidate="torch_native TARGET_VERIFY, tree mask (1 layer)",
        value=stats["tree"].median * 1e6,
        baseline="the same verify as a chain (causal)",
        baseline_value=stats["chain"].median * 1e6,
        unit="us",
        spread=stats["tree"].spread,
        baseline_spread=stats["chain"].spread,
        n=stats["tree"].n,
        target="ratio <= 1.2",
        max_ratio=1.2,
        notes=[
            f"torch threads: {threads}; prepare_batch + init_forward_metadata (once per batch, all layers): "
            f"tree {plans['tree'] * 1e6:.0f} us, chain {plans['chain'] * 1e6:.0f} us"
        ],
    )


def run(rounds: int, quick: bool, threads: int | None, *, verify_only: bool = False) -> list[Row]:
    import torch

    torch.set_grad_enabled(False)
    default_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(rounds, quick, torch.get_num_threads(), verify_only)
    finally:
        torch.set_num_threads(default_threads)


def _run(rounds: int, quick: bool, threads: int, verify_only: bool) -> list[Row]:
    rows: list[Row] = []
    for case in [] if verify_only else _cases(quick):
        rows += _measure(rounds, threads, *case)
    for verify in _verify_cases(quick):
        rows.append(_measure_verify(rounds, threads, *verify))
    return rows


def _measure(
    rounds: int, threads: int, label: str, mode: str, n_req: int, prefix: int, new: int, contiguous: bool
) -> list[Row]:
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    runner, batch, q, k, v, plan_seconds = _setup(mode, n_req, prefix, new, contiguous)
    backend, layer = runner.attn_backend, runner.layers[0]

    def through_runner() -> object:
        with runner.forward_context():
            return backend.forward(q, k, v, layer, batch)

    calls = _record_kernels(through_runner)
    n_sdpa = sum(1 for fn, _, _ in calls if fn is sdpa)
    n_gather = len(calls) - n_sdpa

    def direct() -> None:
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)

    number = max(1, int(0.05 / _once(through_runner)))
    candidates = {"runner": per_call(through_runner, number), "direct": per_call(direct, number)}
    stats = interleaved(candidates, rounds)
    notes = [
        f"torch threads: {threads}; init_forward_metadata (once per batch, all layers): {plan_seconds * 1e6:.0f} us"
    ]

    sdpa_only = f"the same {n_sdpa} SDPA call(s) on the same tensors"
    return [
        Row(
            section="attention overhead",
            case=label,
            candidate="runner torch_native forward (1 layer)",
            value=stats["runner"].median * 1e6,
            baseline=f"the same {n_gather} K/V gather(s) + {sdpa_only}" if n_gather else sdpa_only,
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


def _once(fn: Callable[[], object]) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-6)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from _table import print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--verify-only", action="store_true", help="only the speculative verify (tree vs chain)")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per figure (default: 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as run.py; 0 = torch's)")
    options = parser.parse_args(argv)
    rows = run(options.rounds, options.quick, options.threads or None, verify_only=options.verify_only)
    print_table(rows)
    return 0 if all(row.met is not False for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
