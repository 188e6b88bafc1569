"""Run every attnhost benchmark, print one table, write the figures as JSON.

    python benchmarks/run.py [--quick] [--json PATH] [--only cli,discovery,dispatch,attention,cpukernels]

Each figure is the median of repeated runs; each baseline is measured in the
same invocation, interleaved with its candidate. The last column says
whether the issue's target is met. See BENCHMARKS.md for what each baseline
is and the figures recorded on the reference machine.

Needs torch (dispatch and attention) and, for the stevedore comparisons,
``pip install -r benchmarks/requirements.txt``; missing stevedore is reported
and its rows skipped. The ``cpukernels`` section (bench_cpukernels.py)
needs SGLang and the compiled example plugin, as the ``sglang`` tox
environment has them; elsewhere it is skipped with a note. Synthetic
environments (100 and 1,000 installed distributions, a tenth of them
plugins) are generated under a temporary directory and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Row, machine, make_synthetic_environment, settle_environment  # noqa: E402 - needs sys.path
from _table import print_table  # noqa: E402 - needs sys.path

SECTIONS = ("cli", "discovery", "dispatch", "attention", "cpukernels")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and cases (a smoke run, noisier)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=str(HERE / "results" / "latest.json"),
        help="where to write the figures (JSON)",
    )
    parser.add_argument("--only", metavar="LIST", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch threads for the attention figures (default 1: on shared cores, OpenMP waits for "
        "descheduled threads dominate otherwise; 0 = torch's default)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated environments (path printed)")
    options = parser.parse_args(argv)
    only = [s.strip() for s in options.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    quick = options.quick
    rounds = {
        "cli": 9 if quick else 25,
        "discovery": 7 if quick else 21,
        "dispatch": 7 if quick else 21,
        "attention": 5 if quick else 15,
    }

    notes: list[str] = [
        "CLI subprocesses run with PYTHONDONTWRITEBYTECODE removed and bytecode warmed first "
        "(this environment sets PYTHONDONTWRITEBYTECODE=1; otherwise every run compiles every module from source)",
    ]
    workdir = Path(tempfile.mkdtemp(prefix="attnhost-bench-"))
    info = machine()
    print(
        f"attnhost benchmarks ({'quick' if quick else 'full'}) on {info['cpu_model']}, {info['cpu_count']} CPU(s), "
        f"Python {info['python']}, torch {info['torch']}, pluggy {info['pluggy']}, stevedore {info['stevedore']}",
        flush=True,
    )
    if info["stevedore"] is None:
        notes.append(
            "stevedore is not installed: its comparisons are skipped (pip install -r benchmarks/requirements.txt)"
        )
        print(
            "note: stevedore is not installed; its rows are skipped (pip install -r benchmarks/requirements.txt)",
            flush=True,
        )
    rows: list[Row] = []
    started = time.perf_counter()
    try:
        environments: dict[int, Path] = {}
        if "cli" in only or "discovery" in only:
            print("generating synthetic environments (100 and 1,000 distributions) ...", flush=True)
            for n in (100, 1000):
                environments[n] = make_synthetic_environment(workdir, n, n // 10)
            (workdir / "cwd").mkdir()
            settle_environment()
        if "cli" in only:
            import bench_cli

            print("CLI cold start ...", flush=True)
            rows += bench_cli.run(rounds["cli"], workdir, environments.get(1000), 1000, 100)
        if "discovery" in only:
            import bench_discovery

            print("discovery at scale ...", flush=True)
            rows += bench_discovery.run(rounds["discovery"], workdir, environments)
        if "dispatch" in only:
            import bench_dispatch

            print("dispatch ...", flush=True)
            rows += bench_dispatch.run(rounds["dispatch"], 20_000 if quick else 100_000)
        if "attention" in only:
            import bench_attention

            print("attention overhead, speculative verify (tree vs chain) ...", flush=True)
            rows += bench_attention.run(rounds["attention"], quick, options.threads or None)
        if "cpukernels" in only:
            import importlib.util

            missing = [m for m in ("sglang", "_attnhost_cpukernels") if importlib.util.find_spec(m) is None]
            if missing:
                note = (
                    f"cpukernels: skipped, {' and '.join(missing)} not installed (run it in the `sglang` tox "
                    "environment, which builds examples/attnhost-cpukernels)"
                )
                notes.append(note)
                print(f"note: {note}", flush=True)
            else:
                import bench_cpukernels

                print("compiled CPU kernel (cpu_paged) on SGLang's pools ...", flush=True)
                rows += bench_cpukernels.run(quick)
    finally:
        if options.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print()
    print_table(rows)
    for note in notes:
        print(f"note: {note}")
    missed = [row for row in rows if row.met is False]
    print(f"\n{sum(row.met is True for row in rows)} target(s) met, {len(missed)} missed; {elapsed:.0f} s")
    payload = {
        "command": "python benchmarks/run.py" + (" --quick" if quick else ""),
        "quick": quick,
        "machine": info,
        "elapsed_seconds": elapsed,
        "notes": notes,
        "rows": [row.to_json() for row in rows],
    }
    path = Path(options.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    print(f"figures written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
