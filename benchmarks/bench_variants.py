"""Sliding-window decode against full decode: ``torch_native`` on the same cache, the same batch, one thread.

    python benchmarks/bench_variants.py [--quick] [--dtype bfloat16|float32] [--threads N]

A decode batch of 16 requests x 32,768 cached tokens (``--quick``: 4 x 8,192), 32 query heads over 8 KV heads,
head dim 128, bfloat16 by default: 2.1 GB of K and V in one layer's cache, filled with random values. Each
request's cached tokens are one ascending run of slots (as after its prefill) and its new token's slot comes
after every request's (as a paging allocator hands it out mid-generation), so decode gathers each request's keys,
as it does in a serving engine. Two layers attend the same batch over the same cache:

* **full**: a plain causal layer, which reads every cached key;
* **windowed**: the same layer with ``sliding_window_size=4095`` (HF's ``sliding_window=4096``, Gemma 2's and
  gpt-oss's windows), whose decode must read only each request's last 4,096 keys.

Both outputs are first checked against the float64 reference (two requests, every head). Figures: milliseconds
per layer call (median of interleaved rounds, A, B, A, B, ...; spread = interquartile range over the median), the
K/V bytes each reads, and the ratio full / windowed (target: >= 4x). The ideal ratio is the context over
the window (8x here): what decode is bound by is reading the keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import interleaved, per_call, torch_threads  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TARGET = 4.0


def _setup(requests: int, context: int, dtype: torch.dtype) -> tuple[object, object, object, torch.Tensor]:
    """A runner whose cache holds ``requests`` x ``context`` tokens, the decode batch after them, its queries."""
    from attnhost.forward_mode import ForwardMode
    from attnhost.runner import ModelRunner
    from attnhost.server_args import ServerArgs

    runner = ModelRunner(
        ServerArgs(attention_backend="torch_native"),
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_requests=requests,
        max_context_len=context + 1,
        num_slots=requests * (context + 1),
        dtype=dtype,
    )
    pool = runner.kv_pool
    generator = torch.Generator().manual_seed(0)
    for buffer in (pool.k_buffer(0), pool.v_buffer(0)):
        for rows in buffer.split(1 << 16):  # in place, in pieces: no float32 copy of the whole cache
            rows.copy_(torch.randn(rows.shape, generator=generator))
    for _ in range(requests):
        request = runner.new_request()
        pool.req_to_token[request, :context] = pool.alloc_slots(context)
    batch = runner.prepare_batch(ForwardMode.DECODE, [(r, context, 1) for r in range(requests)])
    queries = torch.randn(requests, HEADS, HEAD_DIM, generator=generator).to(dtype)
    new = torch.randn(requests, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    pool.set_kv(0, batch.out_cache_loc, new, new)
    return runner, batch, runner.layers[0], queries


def _check(runner: object, batch: object, layer: object, q: torch.Tensor, out: torch.Tensor) -> float:
    """Max abs error of ``out`` against the float64 reference over the batch's first two requests."""
    from attnhost.testing.reference import reference_request_attention

    pool = runner.kv_pool  # type: ignore[attr-defined]
    worst = 0.0
    for i in range(2):
        slots = pool.req_to_token[batch.req_pool_indices[i], : batch.seq_lens_cpu[i]]  # type: ignore[attr-defined]
        ref = reference_request_attention(
            q[i : i + 1],
            pool.k_buffer(0)[slots],
            pool.v_buffer(0)[slots],
            prefix_len=batch.prefix_lens_cpu[i],  # type: ignore[attr-defined]
            scaling=layer.scaling,  # type: ignore[attr-defined]
            sliding_window_size=layer.sliding_window_size,  # type: ignore[attr-defined]
        )
        worst = max(worst, float((out[i : i + 1].double() - ref).abs().max()))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 requests x 8,192 tokens, window 1,024, fewer rounds")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the other benchmarks)")
    options = parser.parse_args()
    dtype = getattr(torch, options.dtype)
    requests, context, window = (4, 8192, 1023) if options.quick else (16, 32768, 4095)
    rounds = 3 if options.quick else 7
    with torch.no_grad(), torch_threads(options.threads):
        runner, batch, full, q = _setup(requests, context, dtype)
        windowed = dataclasses.replace(full, sliding_window_size=window)
        row_bytes = 2 * KV_HEADS * HEAD_DIM * q.element_size()  # one token's K and V
        cache_gb = requests * (context + 1) * row_bytes / 1e9
        print(
            f"decode, {requests} requests x {context:,} cached tokens, {HEADS} heads / {KV_HEADS} KV heads, head dim "
            f"{HEAD_DIM}, {options.dtype}, {options.threads} thread(s); cache {cache_gb:.2f} GB of K+V; "
            f"torch {torch.__version__}; load average {os.getloadavg()}"
        )
        backend = runner.attn_backend  # type: ignore[attr-defined]
        atol = 1e-4 if dtype == torch.float32 else 2e-2
        subjects = {}
        for name, layer in (("full", full), (f"windowed (sliding_window_size={window})", windowed)):
            error = _check(
                runner, batch, layer, q, backend.forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], layer, batch, False)
            )
            status = "ok" if error <= atol else "WRONG"
            print(f"{name}: max abs error {error:.1e} against the float64 reference ({status})")
            if error > atol:
                return 1
            subjects[name] = per_call(backend.forward, 1, q, q[:, :KV_HEADS], q[:, :KV_HEADS], layer, batch, False)
        times = interleaved(subjects, rounds)
        keys = {"full": context + 1, "windowed": window + 1}
        print(f"{'layer':<40} {'ms/layer':>9} {'spread':>7} {'K+V read':>10}")
        for name, stats in times.items():
            read = requests * keys[name.split(" ")[0]] * row_bytes
            print(f"{name:<40} {stats.median * 1e3:>9.1f} {stats.spread:>7.1%} {read / 1e6:>8.0f} MB")
        full_ms, windowed_ms = (stats.median for stats in times.values())
        ratio = full_ms / windowed_ms
        print(
            f"windowed decode is {ratio:.1f}x faster than full decode (ideal {(context + 1) / (window + 1):.1f}x, the "
            f"keys read); target >= {TARGET:.0f}x: {'met' if ratio >= TARGET else 'NOT met'}"
        )
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
