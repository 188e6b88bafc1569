"""What the rank-agreement check costs an SGLang engine's start-up with ``tp_size=2``.

    python benchmarks/bench_sglang_tp_agreement.py [--rounds N]   (in the `sglang` tox environment's Python)

Each round starts a real ``sglang.Engine(tp_size=2)`` twice, interleaved (with, without, with, ...),
each in a fresh driver process on the test model of tests/sglang, with the out-of-tree CPU platform.
"Without" is the same engine in which a benchmark-only SGLang plugin (installed as a distribution,
found by SGLang's loader like any plugin) replaces ``check_ranks_agree`` as the agreement hook calls it,
through SGLang's own HookRegistry, by a function that returns at once; "with" wraps it in a timer
instead, so every rank also reports the check's own wall time (fingerprint + one gloo
``all_gather_object``). Start-up is the wall time of the ``sglang.Engine(...)`` constructor.

Engine start-up on a shared 2-core machine moves by seconds between runs, far more than the check
costs, so the A/B medians bound the check only loosely; the check's own time, measured inside the
ranks, is the precise figure, and its ratio to the median start-up is the one compared to the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))  # distgen: plugins written as real distributions

from attnhost_sglang_cpu import shim  # noqa: E402  (the test-only SGLang CPU kit, testkits/attnhost-sglang-cpu)

shim.install()  # SGLang's spawned schedulers re-import this file as __mp_main__ and need it too

MODE_ENV = "ATTNHOST_BENCH_AGREEMENT"  # "on" (timed) or "off" (replaced)
TIMES_ENV = "ATTNHOST_BENCH_AGREEMENT_TIMES"

BENCH_PLUGIN = f'''"""Benchmark-only SGLang plugin: times or replaces attnhost's rank-agreement collective."""
import json, os, time

def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = "attnhost.engines.rank_agreement.check_ranks_agree"
    if os.environ.get("{MODE_ENV}") == "off":
        HookRegistry.register(target, lambda *args, **kwargs: (), HookType.REPLACE)
        return

    def timed(original, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            with open(os.environ["{TIMES_ENV}"], "a") as out:
                out.write(json.dumps({{"pid": os.getpid(), "seconds": time.perf_counter() - started}}) + "\\n")

    HookRegistry.register(target, timed, HookType.AROUND)
'''


def child(model: str) -> None:
    """One engine start, timed; prints ``{"startup": seconds}``."""
    import sglang as sgl

    started = time.perf_counter()
    engine = sgl.Engine(
        model_path=model,
        device="cpu",
        attention_backend="attnhost_torch_native",
        tp_size=2,
        max_total_tokens=4096,
        dtype="float32",
        random_seed=0,
        log_level="error",
    )
    startup = time.perf_counter() - started
    engine.shutdown()
    print(json.dumps({"startup": startup}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="engine starts per arm (default 3)")
    args = parser.parse_args()

    from attnhost_sglang_cpu import sglang_env
    from attnhost_sglang_cpu import tiny_model as tm
    from distgen import make_dist

    root = Path(tempfile.mkdtemp(prefix="bench-tp-agreement-"))
    model = root / "model"
    tm.build_model(model)
    site = root / "site"
    make_dist(
        site,
        "attnhost-bench-agreement",
        "0.0.0",
        {"sglang.srt.plugins": {"attnhost_bench_agreement": "attnhost_bench_agreement:register"}},
        modules={"attnhost_bench_agreement": BENCH_PLUGIN},
    )
    startups: dict[str, list[float]] = {"on": [], "off": []}
    checks: list[float] = []
    schedule = [(-1, "off")]  # an untimed first start: a cold page cache would otherwise count against one arm
    schedule += [(r, mode) for r in range(args.rounds) for mode in (("on", "off") if r % 2 == 0 else ("off", "on"))]
    for round_, mode in schedule:
        times = root / f"check-{round_}-{mode}.jsonl"
        env = sglang_env(
            {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", MODE_ENV: mode, TIMES_ENV: str(times)}, path_entries=[str(site)]
        )
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(model)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            start_new_session=True,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"engine start ({mode}) failed:\n{done.stderr[-4000:]}")
        if round_ < 0:
            print(f"warm-up start: {json.loads(lines[-1])['startup']:6.2f} s (not counted)", flush=True)
            continue
        startups[mode].append(json.loads(lines[-1])["startup"])
        if mode == "on":
            ranks = [json.loads(line)["seconds"] for line in times.read_text().splitlines()]
            if len(ranks) != 2:
                raise SystemExit(f"expected the check's time from 2 ranks, got {ranks}")
            checks.append(max(ranks))
        print(f"round {round_} {mode:>3}: start-up {startups[mode][-1]:6.2f} s", flush=True)
    on, off = statistics.median(startups["on"]), statistics.median(startups["off"])
    check = statistics.median(checks)
    print()
    print(f"engine start-up, tp_size=2, median of {args.rounds}: with the check {on:.2f} s, without {off:.2f} s")
    print(f"  difference of the medians: {on - off:+.2f} s ({(on - off) / off:+.1%}; noise-bound, see above)")
    print(f"the check itself (slowest rank, median): {check * 1e3:.2f} ms = {check / off:.4%} of start-up")
    print(f"target <= 1 %: {'met' if check / off <= 0.01 else 'MISSED'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
