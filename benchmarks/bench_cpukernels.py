"""The compiled example kernel (``cpu_paged``, examples/attnhost-cpukernels) against memory bandwidth and the
``torch_native`` backends, on SGLang's own pools and batches (as bench_sglang_bridge.py), side by side in one run.

    python benchmarks/bench_cpukernels.py [--quick] [--formats]     (in the `sglang` tox environment's Python, which has
                                                          SGLang and the example installed)

Figures (8 query / 2 KV heads, head dim 128, float32, page size 1, slots laid out as the kit's
``shuffled_pages``: fragmented):

* **bandwidth**: decode, 16 requests x 4,096 tokens, the KV bytes the kernel reads per second against a streaming
  read (``torch.sum``) of a buffer far beyond the last-level cache, on as many threads. The two are timed in
  interleaved pairs (stream, kernel, stream, kernel, ...): each kernel call follows a stream that has evicted
  its KV from the caches, so it reads from memory, and a burst of load hits both of a pair alike. The figure is
  the median of the pairs' ratios. One thread on 16 x 4,096; two threads on 16 x 4,096 and on 1 x 4,096.
* **speed-up**: the same decode through SGLang's registry: SGLang's own ``torch_native`` and
  ``attnhost_torch_native`` against ``cpu_paged`` (all three bridged the way SGLang calls them), interleaved.
* **extend**: 4 requests x 128 new tokens over a 1,024-token prefix, the same three.
* **cache formats**: decode 16 x 4,096 on SGLang's pools in pages of 16 with a bfloat16 model, at one and two
  threads: the bfloat16 cache's KV read rate against the stream (as above), an FP8 (e4m3) cache's decode time
  over the bfloat16 cache's, and SGLang's ``torch_native`` against ``cpu_paged`` on the bfloat16 cache. Beside
  them, the **arithmetic floor**: the decode's float32 multiply-adds at torch's own GEMM rate on as many threads,
  and the share of that rate each of the first two targets asks of a float32 kernel (decode reads each key for
  only four query rows, so on a CPU without narrower arithmetic the read rate is bounded by the FMA units, and
  FP8, which halves the bytes but not the arithmetic, cannot go below that floor).
* **adapter overhead**: per layer call, on every case of bench_sglang_bridge.py, the adapter's own work (the
  adapter around a no-op backend minus the no-op alone) over the direct ``cpu_paged`` call.

``run(quick)`` returns the rows for ``benchmarks/run.py`` (section ``cpukernels``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from attnhost_sglang_cpu import shim  # noqa: E402  (the test-only SGLang CPU kit, testkits/attnhost-sglang-cpu)

shim.install()  # SGLang imports torchvision at module level, and PyPI's torchvision cannot import beside the CPU torch

import torch  # noqa: E402
from _common import (  # noqa: E402
    Row,
    bandwidth_pairs,
    interleaved,
    llc_bytes,
    noop_backend,
    per_call,
    stream_buffer,
    torch_threads,
)

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
BACKEND = "cpu_paged"
SECTION = "cpukernels"
FP8 = torch.float8_e4m3fn


class Setup:
    """One SGLang batch on SGLang's pools, with every subject built from SGLang's ``ATTENTION_BACKENDS``."""

    def __init__(
        self,
        label: str,
        prefix: tuple[int, ...],
        extend: tuple[int, ...],
        page_size: int = 1,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        from bench_sglang_bridge import dense_fixture
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.mode = "decode" if not extend else "extend"
        fixture = dense_fixture(
            label,
            self.mode,
            prefix,
            extend,
            "shuffled_pages",
            (HEADS, KV_HEADS, HEAD_DIM),
            page_size=page_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
        )
        case = fixture.case
        self.runner, self.batch, self.layer = fixture.runner, fixture.forward_batch, fixture.actual_module.attn
        tokens = case.num_input_tokens
        self.q = torch.randn(tokens, HEADS * HEAD_DIM).to(dtype)
        self.k = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
        self.v = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
        self.keys = sum(prefix) + tokens  # per KV head, over the batch
        self.kv_bytes = self.keys * KV_HEADS * HEAD_DIM * (kv_dtype or dtype).itemsize * 2
        self.backends = {
            "sglang torch_native": fixture.backend,
            "attnhost_torch_native": ATTENTION_BACKENDS["attnhost_torch_native"](self.runner),
            BACKEND: ATTENTION_BACKENDS[BACKEND](self.runner),
        }
        with torch.no_grad():
            for backend in self.backends.values():
                backend.init_forward_metadata(self.batch)
                backend.forward(self.q, self.k, self.v, self.layer, self.batch)  # first forward converts the layer
            expected = self.backends["sglang torch_native"].forward(self.q, self.k, self.v, self.layer, self.batch)
            got = self.backends[BACKEND].forward(self.q, self.k, self.v, self.layer, self.batch)
        # float32: the two agree to rounding; a 16-bit output: to about one unit in its last place
        atol, rtol = (2e-4, 2e-4) if dtype == torch.float32 else (2e-3, 1.6e-2)
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)

    def call(self, name: str) -> Callable[[], object]:
        backend, args = self.backends[name], (self.q, self.k, self.v, self.layer, self.batch)
        return lambda: backend.forward(*args)


def run(quick: bool = False, log: Callable[[str], None] = print, formats_only: bool = False) -> list[Row]:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import bench_sglang_bridge
    from attnhost_cpukernels.backend import kernel_info

    rows: list[Row] = []
    rounds = 7 if quick else 15
    llc = llc_bytes()
    stream = stream_buffer()
    log(
        f"{BACKEND}: kernel {kernel_info()}; largest cache {llc >> 20} MiB; stream buffer {stream.numel() * 4 >> 20} "
        f"MiB; load average {os.getloadavg()}"
    )
    if formats_only:
        with torch.no_grad():
            return cache_formats(stream, rounds, log)
    with torch.no_grad():
        decode16 = Setup("decode b=16 ctx=4096", (4095,) * 16, ())
        decode1 = Setup("decode b=1 ctx=4096", (4095,), ())
        for threads, setup in ((1, decode16), (2, decode16), (2, decode1)):
            with torch_threads(threads):
                share, kernel_gbs, stream_gbs = bandwidth_pairs(stream, setup.call(BACKEND), setup.kv_bytes, rounds)
            label = f"decode b={setup.batch.batch_size} ctx=4096, {threads} thread(s)"
            log(
                f"  bandwidth {label}: {BACKEND} {kernel_gbs:.1f} GB/s, stream {stream_gbs:.1f} GB/s, median pair "
                f"share {share.median:.0%} (target >= 50%)"
            )
            # as a Row: the kernel's time per byte over the stream's (<= 2: at least half the stream's bandwidth)
            rows.append(
                Row(
                    SECTION,
                    f"KV read, {label}",
                    f"{BACKEND} s/byte",
                    1 / share.median,
                    "stream s/byte",
                    1.0,
                    "x",
                    spread=share.spread,
                    n=share.n,
                    target="bandwidth >= 50% of the stream",
                    max_ratio=2.0,
                    notes=[f"{BACKEND} {kernel_gbs:.1f} GB/s, stream {stream_gbs:.1f} GB/s (medians)"],
                )
            )
        with torch_threads(1):
            for setup, targets in (
                (decode16, {"sglang torch_native": 5.0, "attnhost_torch_native": 2.5}),
                (Setup("extend b=4 new=128 prefix=1024", (1024,) * 4, (128,) * 4), None),
            ):
                number = 2 if setup.mode == "decode" else 3
                stats = interleaved({name: per_call(setup.call(name), number) for name in setup.backends}, rounds)
                ours = stats[BACKEND]
                for name in ("sglang torch_native", "attnhost_torch_native"):
                    speed_up = 1.0 if targets is None else targets[name]
                    label = "decode b=16 ctx=4096" if setup.mode == "decode" else "extend b=4 new=128 prefix=1024"
                    log(
                        f"  {label}, 1 thread: {BACKEND} {ours.median * 1e3:.2f} ms, {name} "
                        f"{stats[name].median * 1e3:.2f} ms: {stats[name].median / ours.median:.2f}x "
                        f"(target >= {speed_up:g}x)"
                    )
                    rows.append(
                        Row(
                            SECTION,
                            f"{label}, 1 thread",
                            BACKEND,
                            ours.median * 1e6,
                            name,
                            stats[name].median * 1e6,
                            "us",
                            spread=ours.spread,
                            baseline_spread=stats[name].spread,
                            n=ours.n,
                            target=f"speed-up >= {speed_up:g}x",
                            max_ratio=1 / speed_up,
                        )
                    )
        del decode16, decode1
        rows += cache_formats(stream, rounds, log)
        # the adapter's own cost per layer call against this kernel, on every case of the bridge benchmark
        worst = 0.0
        with torch_threads(1):
            for label, _mode, prefix, extend in bench_sglang_bridge._cases(quick):
                setup = Setup(label, prefix, extend)
                bridge = setup.backends[BACKEND]
                inner, attnhost_batch = bridge.attnhost_backend, bridge._batch
                attnhost_layer = bridge._layers[setup.layer.layer_id]
                q3 = setup.q.view(-1, HEADS, HEAD_DIM)
                direct = inner.forward_decode if setup.mode == "decode" else inner.forward_extend
                number = max(3, int(3e5 // (sum(prefix) + len(setup.q) + 1)))
                noop = noop_backend()
                stats = interleaved(
                    {"direct": per_call(direct, number, q3, setup.k, setup.v, attnhost_layer, attnhost_batch)},
                    rounds,
                )
                bridge.attnhost_backend = noop
                bridged = bridge.forward_decode if setup.mode == "decode" else bridge.forward_extend
                noop_method = noop.forward_decode if setup.mode == "decode" else noop.forward_extend
                args = (setup.q, setup.k, setup.v, setup.layer, setup.batch)
                costs = interleaved(
                    {
                        "bridged": per_call(bridged, 2000, *args),
                        "alone": per_call(noop_method, 2000, q3, setup.k, setup.v, attnhost_layer, attnhost_batch),
                    },
                    rounds,
                )
                bridge.attnhost_backend = inner
                adapter = max(0.0, costs["bridged"].median - costs["alone"].median)
                d = stats["direct"].median
                worst = max(worst, adapter / d)
                log(
                    f"  adapter {label}: {adapter * 1e6:.2f} us over {BACKEND} {d * 1e6:.0f} us = "
                    f"{adapter / d:.2%} (target <= 3%)"
                )
                rows.append(
                    Row(
                        SECTION,
                        f"adapter, {label}",
                        "bridged",
                        d + adapter,
                        "direct",
                        d,
                        "us",
                        spread=stats["direct"].spread,
                        n=stats["direct"].n,
                        target="ratio <= 1.03",
                        max_ratio=1.03,
                    )
                )
                del setup
    log(f"worst adapter overhead {worst:.2%}; load average at the end {os.getloadavg()}")
    return rows


def cache_formats(stream: torch.Tensor, rounds: int, log: Callable[[str], None]) -> list[Row]:
    """Decode 16 x 4,096 on SGLang's pools in pages of 16 (``--page-size 16``), bfloat16 model: the bfloat16
    cache's KV read rate against the stream, an FP8 (e4m3) cache's decode time over the bfloat16 cache's, and
    ``cpu_paged`` against SGLang's ``torch_native`` on the bfloat16 cache; at one thread and at two."""
    rows: list[Row] = []
    label = "decode b=16 ctx=4096, page 16"
    bf16 = Setup(f"{label}, bfloat16", (4095,) * 16, (), page_size=16, dtype=torch.bfloat16)
    fp8 = Setup(f"{label}, fp8_e4m3", (4095,) * 16, (), page_size=16, dtype=torch.bfloat16, kv_dtype=FP8)
    for threads in (1, 2):
        with torch_threads(threads):
            share, kernel_gbs, stream_gbs = bandwidth_pairs(stream, bf16.call(BACKEND), bf16.kv_bytes, rounds)
            mac_rate = gemm_mac_rate()
            times = interleaved(
                {
                    "fp8": per_call(fp8.call(BACKEND), 2),
                    "bf16": per_call(bf16.call(BACKEND), 2),
                    "torch_native": per_call(bf16.call("sglang torch_native"), 1),
                },
                rounds,
            )
        where = f"{label}, {threads} thread(s)"
        fp8_ratio = times["fp8"].median / times["bf16"].median
        speed_up = times["torch_native"].median / times["bf16"].median
        log(
            f"  bandwidth {where}, bfloat16 cache: {BACKEND} {kernel_gbs:.1f} GB/s, stream {stream_gbs:.1f} GB/s, "
            f"median pair share {share.median:.0%} (target >= 75%)"
        )
        log(
            f"  {where}: fp8_e4m3 cache {times['fp8'].median * 1e3:.2f} ms, bfloat16 cache "
            f"{times['bf16'].median * 1e3:.2f} ms: {fp8_ratio:.2f} (target <= 0.6); sglang torch_native "
            f"{times['torch_native'].median * 1e3:.1f} ms: {speed_up:.1f}x (target >= 5x)"
        )
        # The decode's arithmetic at the core's own float32 GEMM rate: the least time any float32 kernel needs, and
        # the share of that rate the two targets ask for (above 100%: out of reach for float32 arithmetic).
        floor = decode_macs(bf16) / mac_rate
        at_target = bf16.kv_bytes / (0.75 * stream_gbs * 1e9)
        log(
            f"  {where}: float32 GEMM {mac_rate / 1e9:.1f} GMAC/s, so the decode's arithmetic takes at least "
            f"{floor * 1e3:.2f} ms; bfloat16 at 75% of the stream ({at_target * 1e3:.2f} ms) needs "
            f"{floor / at_target:.0%} of that rate, FP8 at 0.6 x that {floor / (0.6 * at_target):.0%}, and "
            f"{BACKEND} runs the bfloat16 cache at {floor / times['bf16'].median:.0%}, FP8 at "
            f"{floor / times['fp8'].median:.0%}"
        )
        rows += [
            Row(
                SECTION,
                f"arithmetic floor, {where}, bfloat16 cache",
                BACKEND,
                times["bf16"].median * 1e6,
                "float32 GEMM rate",
                floor * 1e6,
                "us",
                n=times["bf16"].n,
                notes=[
                    f"{mac_rate / 1e9:.1f} GMAC/s; bfloat16 at 75% of the stream needs {floor / at_target:.0%} of it, "
                    f"FP8 at 0.6 x that {floor / (0.6 * at_target):.0%}"
                ],
            ),
            Row(
                SECTION,
                f"KV read, {where}, bfloat16 cache",
                f"{BACKEND} s/byte",
                1 / share.median,
                "stream s/byte",
                1.0,
                "x",
                spread=share.spread,
                n=share.n,
                target="bandwidth >= 75% of the stream",
                max_ratio=1 / 0.75,
                notes=[f"{BACKEND} {kernel_gbs:.1f} GB/s, stream {stream_gbs:.1f} GB/s (medians)"],
            ),
            Row(
                SECTION,
                f"{where}, fp8_e4m3 over bfloat16 cache",
                "fp8_e4m3 cache",
                times["fp8"].median * 1e6,
                "bfloat16 cache",
                times["bf16"].median * 1e6,
                "us",
                spread=times["fp8"].spread,
                baseline_spread=times["bf16"].spread,
                n=times["fp8"].n,
                target="ratio <= 0.6",
                max_ratio=0.6,
            ),
            Row(
                SECTION,
                f"{where}, bfloat16 cache",
                BACKEND,
                times["bf16"].median * 1e6,
                "sglang torch_native",
                times["torch_native"].median * 1e6,
                "us",
                spread=times["bf16"].spread,
                baseline_spread=times["torch_native"].spread,
                n=times["bf16"].n,
                target="speed-up >= 5x",
                max_ratio=1 / 5,
            ),
        ]
    return rows


def decode_macs(setup: Setup) -> int:
    """Multiply-adds of one decode: each key of each KV head against the group's query rows, once for the scores
    and once for the values."""
    return setup.keys * KV_HEADS * (HEADS // KV_HEADS) * HEAD_DIM * 2


def gemm_mac_rate(n: int = 256, rounds: int = 15) -> float:
    """Float32 multiply-adds per second of torch's GEMM (its BLAS, tuned to this CPU) on the current threads: the
    arithmetic rate a well-tuned float32 kernel reaches here, best of ``rounds`` (the highest rate: the floor it
    gives is the least any float32 kernel could need)."""
    timer = per_call(torch.mm, 1, torch.randn(n, n), torch.randn(n, n))
    return n**3 / min(timer() for _ in range(rounds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and bridge cases")
    parser.add_argument("--formats", action="store_true", help="only the cache formats (pages, FP8)")
    options = parser.parse_args()
    rows = run(options.quick, formats_only=options.formats)
    print()
    for row in rows:
        if row.target is None:  # the arithmetic floor: the share of the GEMM rate the kernel runs at
            figure, what = 1 / row.ratio, f"of the {row.baseline}"
        elif "bandwidth" in (row.target or ""):
            figure, what = 1 / row.ratio, "of the stream's bandwidth"
        elif "speed-up" in (row.target or ""):
            figure, what = 1 / row.ratio, f"x faster than {row.baseline}"
        else:
            figure, what = row.ratio, f"x {row.baseline}"
        print(f"{row.case:<52} {figure:>7.3f} {what:<40} {'' if row.met is None else 'met' if row.met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
