"""The compiled example kernel (``cpu_paged``, examples/attnhost-cpukernels) against memory bandwidth and the
``torch_native`` backends, on SGLang's own pools and batches (as bench_sglang_bridge.py), side by side in one run.

    python benchmarks/bench_cpukernels.py [--quick]     (in the `sglang` tox environment's Python, which has
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


class Setup:
    """One SGLang batch on SGLang's pools, with every subject built from SGLang's ``ATTENTION_BACKENDS``."""

    def __init__(self, label: str, prefix: tuple[int, ...], extend: tuple[int, ...]) -> None:
        from bench_sglang_bridge import dense_fixture
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.mode = "decode" if not extend else "extend"
        fixture = dense_fixture(label, self.mode, prefix, extend, "shuffled_pages", (HEADS, KV_HEADS, HEAD_DIM))
        case = fixture.case
        self.runner, self.batch, self.layer = fixture.runner, fixture.forward_batch, fixture.actual_module.attn
        tokens = case.num_input_tokens
        self.q = torch.randn(tokens, HEADS * HEAD_DIM)
        self.k = torch.randn(tokens, KV_HEADS, HEAD_DIM)
        self.v = torch.randn(tokens, KV_HEADS, HEAD_DIM)
        self.kv_bytes = (sum(prefix) + tokens) * KV_HEADS * HEAD_DIM * 4 * 2
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
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)

    def call(self, name: str) -> Callable[[], object]:
        backend, args = self.backends[name], (self.q, self.k, self.v, self.layer, self.batch)
        return lambda: backend.forward(*args)


def run(quick: bool = False, log: Callable[[str], None] = print) -> list[Row]:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and bridge cases")
    options = parser.parse_args()
    rows = run(options.quick)
    print()
    for row in rows:
        if "bandwidth" in (row.target or ""):
            figure, what = 1 / row.ratio, "of the stream's bandwidth"
        elif "speed-up" in (row.target or ""):
            figure, what = 1 / row.ratio, f"x faster than {row.baseline}"
        else:
            figure, what = row.ratio, f"x {row.baseline}"
        print(f"{row.case:<52} {figure:>7.3f} {what:<40} {'met' if row.met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
