"""A real ``sglang.Engine`` on the CPU generates HF transformers' greedy ids with every backend.

One run of the test kit's engine driver (``python -m attnhost_sglang_cpu.run_engine``),
in a fresh interpreter and process group, builds an engine per backend in turn:
SGLang's own loader finds attnhost's general plugin and the kit's test-only
CPU platform and probe; SGLang's scheduler, model runner, pools and sampler do
the rest. Each backend's probe record (written by its spawned scheduler) shows
which backend class each model runner built and that extend and decode ran.
"""

from __future__ import annotations

import pytest
from attnhost_sglang_cpu.e2e import ADAPTER, SGLANG_TORCH_NATIVE, EngineRuns, TinyModel, check_probe, read_probe
from attnhost_sglang_cpu.e2e import run_engines as kit_run_engines
from conftest import NEW_TOKENS

BACKENDS = {
    "torch_native": SGLANG_TORCH_NATIVE,  # SGLang keeps its own under its own name
    "attnhost_torch_native": ADAPTER,  # attnhost's built-in, under its documented clash-free name
    "tiny": ADAPTER,  # examples/attnhost-tiny
    "batched_matmul": ADAPTER,  # examples/attnhost-batched
    "cpu_paged": ADAPTER,  # examples/attnhost-cpukernels (a compiled C++ kernel)
}


@pytest.fixture(scope="module")
def engine_runs(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    """Every backend's engine, one after another in one driver process: one of the slow set-ups, each backend's
    engine with SGLang's defaults, a configuration no other test starts."""
    return kit_run_engines(
        tiny_model.path,
        tiny_model.prompts,
        NEW_TOKENS,
        [{"backend": name} for name in BACKENDS],
        tmp_path_factory.mktemp("engine-probes"),
    )


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
