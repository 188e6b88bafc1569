"""Building the registry at scale: linear in the number of specs.

    python benchmarks/bench_registry.py [--quick]

One in-process plugin returns N ``BackendSpec``s and declares N/2 of them
draft-capable; the figure is the time from a fresh host to its registry
(hooks asked through pluggy, specs merged, draft order computed). The
baseline, measured interleaved in the same run, is the floor no registry
can beat: the plugin building its N specs, with nothing registered. The
last column is the cost per spec; a linear build keeps it flat from 10,000
to 100,000 specs (the quadratic draft-order loop this replaced took about
10 s at 100,000 specs and 50,000 draft names).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Stats, interleaved  # noqa: E402 - needs sys.path


class _ManySpecs:
    """A plugin with ``n`` backends, every second one draft-capable."""

    def __init__(self, n: int) -> None:
        self.names = [f"backend_{i:06d}" for i in range(n)]

    def specs(self) -> list[object]:
        from attnhost import BackendSpec

        return [BackendSpec(name=name, factory="vendor_kernels:Backend") for name in self.names]


def _subjects(n: int) -> dict[str, object]:
    import attnhost
    from attnhost.host import _reset_for_tests

    plugin = _ManySpecs(n)

    class Plugin:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[object]:
            return plugin.specs()

        @attnhost.hookimpl
        def attnhost_draft_attention_backends(self) -> list[str]:
            return plugin.names[::2]

    def build() -> float:
        _reset_for_tests()
        attnhost.get_plugin_manager()  # the built-in loaded outside the timed part
        attnhost.register_plugin(Plugin(), name="many")
        start = time.perf_counter()
        registry = attnhost.get_registry()
        elapsed = time.perf_counter() - start
        assert len(registry.names("draft")) >= n // 2 and len(registry) >= n
        return elapsed

    def floor() -> float:
        start = time.perf_counter()
        plugin.specs()
        return time.perf_counter() - start

    return {"registry": build, "specs only": floor}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and sizes (a smoke run, noisier)")
    options = parser.parse_args(argv)
    os.environ["ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the built-in and the synthetic plugin only
    sizes = (10_000, 100_000) if options.quick else (10_000, 25_000, 50_000, 100_000)
    rounds = 3 if options.quick else 7
    print(f"{'specs':>8}  {'registry':>10}  {'specs only':>10}  {'ratio':>6}  {'per spec':>9}  spread")
    per_spec: dict[int, float] = {}
    for n in sizes:
        stats: dict[str, Stats] = interleaved(_subjects(n), rounds)  # type: ignore[arg-type]
        build, floor = stats["registry"], stats["specs only"]
        per_spec[n] = build.median / n
        print(
            f"{n:>8,}  {build.median * 1e3:>8.0f}ms  {floor.median * 1e3:>8.0f}ms  "
            f"{build.median / floor.median:>6.2f}  {per_spec[n] * 1e6:>7.2f}us  ±{build.spread:.0%}"
        )
    small, large = min(sizes), max(sizes)
    print(f"\nper-spec cost at {large:,} / at {small:,}: {per_spec[large] / per_spec[small]:.2f} (1.0 = linear)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
