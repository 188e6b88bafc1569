"""A real ``sglang.Engine`` on the CPU with ``--page-size 16`` and with ``--kv-cache-dtype fp8_e4m3``, on attnhost's
``torch_native`` and on SGLang's own, in one run of the test kit's engine driver (four engines, one after another).

Pages change where tokens sit, never what attention computes: greedy ids equal HF transformers' for both
backends, on prompts of 27 and 45 tokens (prefills end inside a page, and decodes cross into the next), on a
first pass and on a second whose prompts SGLang finds in its radix cache (whole pages of them). FP8 changes what
the cache holds, so the oracle is SGLang's own ``torch_native`` with the same cache: the ids must equal its ids
(the tiny model's scales are 1, the only scale that backend reads) and so must the log-probabilities of the
generated tokens, which (unlike the ids, on this model) show that FP8 changed the numbers; the probe shows both
runners allocated the FP8 pool and that attnhost's backend saw its dtype and page size.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from attnhost_sglang_cpu import tiny_model as tm
from attnhost_sglang_cpu.e2e import ADAPTER, SGLANG_TORCH_NATIVE, EngineRuns, TinyModel, read_probe
from attnhost_sglang_cpu.e2e import run_engines as kit_run_engines
from conftest import NEW_TOKENS

PAGED = {"page_size": 16}
FP8 = {"kv_cache_dtype": "fp8_e4m3"}
RUNS = {
    "sglang-page16": ("torch_native", PAGED),
    "ours-page16": ("attnhost_torch_native", PAGED),
    "sglang-fp8": ("torch_native", FP8),
    "ours-fp8": ("attnhost_torch_native", FP8),
}


#: Prompt lengths whose prefills end inside a page of 16, which the 8 decoded tokens then leave.
LENGTHS = (27, 45)


@pytest.fixture(scope="module")
def long_model(tiny_model: TinyModel) -> TinyModel:
    """The tiny Llama with prompts longer than a page (its own, repeated), and HF's greedy ids for them."""
    prompts = [(tiny_model.prompts[i % 2] * 40)[:n] for i, n in enumerate(LENGTHS)]
    return TinyModel(tiny_model.path, prompts, tm.hf_greedy(tiny_model.path, prompts, NEW_TOKENS))


@pytest.fixture(scope="module")
def engine_runs(long_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    """SGLang's and attnhost's torch_native in pages of 16 and over FP8 caches, one after another in one driver
    process: one of the slow set-ups, engine configurations no other test starts."""
    runs = [
        {"name": name, "backend": backend, "engine_args": args, "passes": 2 if args is PAGED else 1, "logprobs": True}
        for name, (backend, args) in RUNS.items()
    ]
    probes = tmp_path_factory.mktemp("kv-format-probes")
    done = kit_run_engines(long_model.path, long_model.prompts, NEW_TOKENS, runs, probes)
    (probes / "results.json").write_text(json.dumps({"hf": long_model.hf_ids, **done.results}, indent=1))
    return done


def _result(engine_runs: EngineRuns, name: str) -> dict[str, Any]:
    result = engine_runs.results[name]
    assert "error" not in result, f"sglang.Engine run {name!r} failed:\n{result['error']}"
    assert result["children_left"] == [], result["children_left"]
    return result


def _runner(engine_runs: EngineRuns, name: str) -> dict[str, Any]:
    runners = [r for r in read_probe(engine_runs.probes[name]) if r["event"] == "runner"]
    assert len(runners) == 1, runners
    return runners[0]


@pytest.mark.parametrize("name", ["sglang-page16", "ours-page16"])
def test_paged_engine_greedy_ids_equal_hf(name: str, engine_runs: EngineRuns, long_model: TinyModel) -> None:
    result = _result(engine_runs, name)
    assert result["output_ids"] == long_model.hf_ids
    for later in result["later_passes"]:  # the prompts found in the radix cache, in whole pages
        assert later["output_ids"] == long_model.hf_ids
        assert all(meta["cached_tokens"] > 0 for meta in later["meta_info"]), later["meta_info"]
    runner = _runner(engine_runs, name)
    assert runner["kv_pool_format"]["page_size"] == 16, runner
    if name.startswith("ours"):
        assert runner["backend_class"] == ADAPTER
        assert runner["attnhost_kv_format"] == {"dtype": "torch.float32", "page_size": 16}, runner
    else:
        assert runner["backend_class"] == SGLANG_TORCH_NATIVE


def _gap(first: dict[str, Any], second: dict[str, Any]) -> float:
    """The largest difference between two runs' log-probabilities of the same generated tokens."""
    assert first["output_ids"] == second["output_ids"]
    pairs = zip(first["logprobs"], second["logprobs"], strict=True)
    return max(abs(a - b) for ours, theirs in pairs for a, b in zip(ours, theirs, strict=True))


def test_paged_engine_log_probabilities_equal_sglangs(engine_runs: EngineRuns) -> None:
    assert _gap(_result(engine_runs, "ours-page16"), _result(engine_runs, "sglang-page16")) < 1e-4


def test_fp8_engine_greedy_ids_equal_sglangs_torch_native(engine_runs: EngineRuns) -> None:
    ours, theirs = _result(engine_runs, "ours-fp8"), _result(engine_runs, "sglang-fp8")
    assert ours["output_ids"] == theirs["output_ids"]
    assert _gap(ours, theirs) < 1e-4  # the same FP8 cache read the same way
    assert _gap(theirs, _result(engine_runs, "sglang-page16")) > 1e-3  # and FP8 changed the numbers
    for name in ("ours-fp8", "sglang-fp8"):
        assert _runner(engine_runs, name)["kv_pool_format"]["dtype"] == "torch.float8_e4m3fn"
    runner = _runner(engine_runs, "ours-fp8")
    assert runner["backend_class"] == ADAPTER
    assert runner["attnhost_kv_format"] == {"dtype": "torch.float8_e4m3fn", "page_size": 1}, runner


def test_engine_drivers_left_nothing_behind(engine_runs: EngineRuns) -> None:
    for done in engine_runs.drivers:
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.leftover == "none"
