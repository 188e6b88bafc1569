"""A real ``sglang.Engine`` on the CPU generates HF transformers' greedy ids with every backend (issue 16).

One run of scaffolding/run_engine.py, in a fresh interpreter and process
group, builds an engine per backend in turn: SGLang's own loader finds
attnhost's general plugin, the test-only CPU platform and the probe; SGLang's
scheduler, model runner, pools and sampler do the rest. Each backend's probe
record (written by its spawned scheduler) shows which backend class each model
runner built and that extend and decode ran.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sgl_e2e import ADAPTER, NEW_TOKENS, SGLANG_TORCH_NATIVE, TinyModel, check_probe, read_probe
from sgl_procs import Finished, run_in_group
from sgl_scaffold import SCAFFOLDING, sglang_env

BACKENDS = {
    "torch_native": SGLANG_TORCH_NATIVE,  # SGLang keeps its own under its own name
    "attnhost_torch_native": ADAPTER,  # attnhost's built-in, under its documented clash-free name
    "tiny": ADAPTER,  # examples/attnhost-tiny
    "batched_matmul": ADAPTER,  # examples/attnhost-batched
    "cpu_paged": ADAPTER,  # examples/attnhost-cpukernels (a compiled C++ kernel)
}


@dataclass(frozen=True)
class EngineRuns:
    drivers: list[Finished]  # one per driver run (more than one only when a crash ended a driver early)
    results: dict[str, dict[str, Any]]
    probes: dict[str, Path]


@pytest.fixture(scope="module")
def engine_runs(tiny_model: TinyModel, sglang_site: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    """Run every backend's engine; a backend whose scheduler crashes takes SGLang's driver down with it (SGLang
    kills its process tree on a child's failure), so the driver is started again for the backends after it."""
    probes_dir = tmp_path_factory.mktemp("engine-probes")
    probes = {name: probes_dir / f"{name}.jsonl" for name in BACKENDS}
    results: dict[str, dict[str, Any]] = {}
    drivers: list[Finished] = []
    remaining = list(BACKENDS)
    while remaining:
        job = {
            "model": str(tiny_model.path),
            "prompts": tiny_model.prompts,
            "new_tokens": NEW_TOKENS,
            "runs": [{"backend": name, "probe": str(probes[name])} for name in remaining],
        }
        done = run_in_group(
            [sys.executable, str(SCAFFOLDING / "run_engine.py"), json.dumps(job)], sglang_env(sglang_site), timeout=540
        )
        drivers.append(done)
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results[record["backend"]] = record
        missing = [name for name in remaining if name not in results]
        if missing:
            results[missing[0]] = {
                "backend": missing[0],
                "error": f"the engine driver died (exit status {done.returncode}):\n{done.stderr[-4000:]}",
            }
        remaining = missing[1:]
    return EngineRuns(drivers, results, probes)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_engine_greedy_ids_equal_hf(backend: str, engine_runs: EngineRuns, tiny_model: TinyModel) -> None:
    result = engine_runs.results[backend]
    assert "error" not in result, f"sglang.Engine with {backend!r} failed:\n{result['error']}"
    assert result["output_ids"] == tiny_model.hf_ids
    check_probe(read_probe(engine_runs.probes[backend]), backend, BACKENDS[backend], not_pid=result["driver_pid"])
    assert result["children_left"] == [], f"Engine.shutdown() left processes behind: {result['children_left']}"


def test_engine_drivers_left_nothing_behind(engine_runs: EngineRuns) -> None:
    for done in engine_runs.drivers:
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.leftover == "none"
