"""A real ``sglang.Engine`` decoding inside SGLang's own CPU graph runner, with an attnhost backend: HF's ids.

The test platform's graph variant (``ATTNHOST_TEST_CPU_GRAPHS=1``) reports graph capture and returns SGLang's
``CPUGraphRunner`` (started with the kit's stand-ins for the ``sgl_kernel`` operators it registers fake kernels
for); with ``--enable-torch-compile`` SGLang compiles the model's forward for the captured batch sizes 1, 2 and 4
and runs every decode step of up to four requests through it. Three requests run, so each decode step is padded
to the captured size 4 (SGLang's padding: request row 0, length 1, slot 0), and a second pass finds the prompts in
the radix cache. Two engines, one after the other in one driver: ``batched_matmul`` (Python), and the compiled
example ``cpu_paged`` (a torch custom operator over a plan in tensors) on a paged cache of 16-token pages; both
declare graph support, and the adapter plans every step into the buffers it allocated when the runner started.
The probe shows the captures and the padded replays of each.

SGLang 0.5.23's ``CPUGraphRunner`` refuses speculative decoding outright ("CPUGraphRunner does not support
speculative inference yet") and an EAGLE draft worker captures no graph where ``is_cpu()`` holds, so a
speculative chain cannot run inside a graph here; the adapter's verify and draft-decode graph steps are checked
in the CUDA runners' order in tests/sglang/test_spec_graphs.py, its decode ones in tests/sglang/test_graphs.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from attnhost_sglang_cpu.e2e import ADAPTER, EngineRuns, TinyModel, read_probe
from attnhost_sglang_cpu.e2e import run_engines as kit_run_engines
from conftest import NEW_TOKENS

CAPTURED = [1, 2, 4]
GRAPH_ENGINE_ARGS = {"cuda_graph_bs_decode": CAPTURED, "enable_torch_compile": True, "torch_compile_max_bs": 4}
RUNS = {"batched_matmul": {}, "cpu_paged": {"page_size": 16}}
"""Each graph-capable example's engine, and what its configuration adds."""


@pytest.fixture(scope="module")
def graph_run(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineRuns, list[list[int]]]:
    """One engine with SGLang's CPU graph runner and ``torch.compile`` (its start compiles three batch sizes, so
    this is one of the slow set-ups): a configuration no other test shares. Three prompts (the fixture's two and the
    first without its last token) and HF's greedy ids for them."""
    import attnhost_sglang_cpu.tiny_model as tm

    prompts = [*tiny_model.prompts, tiny_model.prompts[0][:-1]]
    hf_ids = [*tiny_model.hf_ids, *tm.hf_greedy(tiny_model.path, prompts[2:], NEW_TOKENS)]
    runs = kit_run_engines(
        tiny_model.path,
        prompts,
        NEW_TOKENS,
        [
            {"name": backend, "backend": backend, "passes": 2, "engine_args": {**GRAPH_ENGINE_ARGS, **extra}}
            for backend, extra in RUNS.items()
        ],
        tmp_path_factory.mktemp("graph-probes"),
        env={"ATTNHOST_TEST_CPU_GRAPHS": "1"},
        timeout=900,
    )
    return runs, hf_ids


def _result(graph_run: tuple[EngineRuns, list[list[int]]], backend: str) -> dict[str, Any]:
    result = graph_run[0].results[backend]
    assert "error" not in result, f"sglang.Engine with CPU graphs and {backend} failed:\n{result['error'][-4000:]}"
    return result


@pytest.mark.parametrize("backend", RUNS)
def test_greedy_ids_equal_hf_first_and_prefix_cached_pass(
    graph_run: tuple[EngineRuns, list[list[int]]], backend: str
) -> None:
    result, hf_ids = _result(graph_run, backend), graph_run[1]
    assert result["output_ids"] == hf_ids
    assert [p["output_ids"] for p in result["later_passes"]] == [hf_ids]
    assert result["children_left"] == [], f"Engine.shutdown() left processes behind: {result['children_left']}"


@pytest.mark.parametrize("backend", RUNS)
def test_the_probe_saw_captures_and_padded_replays_through_the_adapter(
    graph_run: tuple[EngineRuns, list[list[int]]], backend: str
) -> None:
    _result(graph_run, backend)
    records = read_probe(Path(graph_run[0].probes[backend]))
    captures = [r for r in records if r["event"] == "graph_capture"]
    assert sorted(r["bs"] for r in captures) == CAPTURED
    assert {r["backend_class"] for r in captures} == {ADAPTER}
    replays = [r for r in records if r["event"] == "graph_replay"]
    assert any(r["asked_bs"] == 3 and r["ran_bs"] == 4 for r in replays), replays  # padded to the captured size
    assert len(replays) >= 2 * (NEW_TOKENS - 1), f"{len(replays)} graph steps for two passes of {NEW_TOKENS} tokens"
