"""MLA models in a real ``sglang.Engine`` on the CPU, attention by attnhost: tiny random DeepSeek-V2
models made locally, greedy ids equal HF transformers' (eager), also on a second, prefix-cached pass.

All runs go through one engine driver (the test kit's ``run_engine``), one engine after another, to keep the CI
budget:

* each of the two latent shapes (``kv_lora_rank`` 32 + rope 16, 256 + rope 32) on ``attnhost_torch_native``,
  generating twice: the first pass prefills through MLA's MHA form, the second finds the prompts in the radix
  cache and extends over them through the absorbed form;
* the scenario of SGLang #28559: the MLA target on ``attnhost_torch_native`` with a STANDALONE draft (a plain
  one-layer Llama sharing the tokenizer) on ``tiny``, prefix cache on: the ids equal the plain run's, verify ran,
  and the probe shows the target runner's stamps stay ``attnhost_torch_native``, the draft's ``tiny``, and every
  target forward, ``TARGET_VERIFY`` included, ran torch_native's MLA code (never tiny's);
* ``tp_size=2``: the ids equal ``tp_size=1``'s, the MLA adapter in both ranks;
* the example plugin's ``batched_matmul`` (its own MLA kernels) on the small latent shape, generating twice like
  torch_native, so a plugin other than the built-in one serves both forms inside the engine.

The probe hooks the attnhost backend classes themselves (``ATTNHOST_TEST_PROBE_TARGETS``), so its records say
which backend's code ran which MLA form, in which mode, for which runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from attnhost_sglang_cpu import SPECULATIVE_ENV
from attnhost_sglang_cpu import tiny_model as tm
from attnhost_sglang_cpu.e2e import ADAPTER, MLA_ADAPTER, EngineRuns, TinyModel, read_probe, run_engines
from attnhost_sglang_cpu.run_engine import speculative_args
from conftest import NEW_TOKENS

TARGET, DRAFT, BATCHED = "attnhost_torch_native", "tiny", "batched_matmul"
TORCH_NATIVE = "attnhost_builtin.torch_native.TorchNativeAttnBackend"
TINY = "attnhost_tiny.TinyAttnBackend"
BATCHED_CODE = "attnhost_batched.backend.BatchedMatmulAttnBackend"
PROBE_TARGETS = {
    "ATTNHOST_TEST_PROBE_TARGETS": "attnhost_builtin.torch_native:TorchNativeAttnBackend,attnhost_tiny:TinyAttnBackend,"
    "attnhost_batched.backend:BatchedMatmulAttnBackend"
}
RANK_CPUS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
SHAPES = {f"latent{rank}": (rank, rope) for rank, rope in tm.LATENT_SHAPES}
# run name -> (latent shape, backend, the class whose MLA code must have run) of the plain two-pass runs
PLAIN_RUNS = {name: (name, TARGET, TORCH_NATIVE) for name in SHAPES} | {"batched": ("latent32", BATCHED, BATCHED_CODE)}


@dataclass(frozen=True)
class MLARuns:
    models: dict[str, TinyModel]  # by shape name
    runs: EngineRuns


@pytest.fixture(scope="module")
def mla_runs(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> MLARuns:
    """The DeepSeek-shaped engines (each latent shape, speculative, two ranks, the batched example, a refused
    draft), one after another in one driver process: one of the slow set-ups, engine configurations no other test
    starts."""
    models = {}
    for name, (rank, rope) in SHAPES.items():
        path = tmp_path_factory.mktemp(f"tiny-deepseek-{name}")
        tm.build_deepseek_model(path, kv_lora_rank=rank, qk_rope_head_dim=rope, tokenizer_from=tiny_model.path)
        hf_ids = tm.hf_greedy(path, tiny_model.prompts, NEW_TOKENS)
        assert hf_ids[0] != hf_ids[1] and len(set(hf_ids[0])) > 4, hf_ids  # ids that depend on the prompt
        models[name] = TinyModel(path, tiny_model.prompts, hf_ids)
    draft = tmp_path_factory.mktemp("llama-draft")
    tm.build_draft_model(draft, tiny_model.path)
    small = str(models["latent32"].path)
    runs: list[dict[str, Any]] = [
        {"name": name, "backend": TARGET, "model": str(model.path), "passes": 2} for name, model in models.items()
    ]
    spec = speculative_args(str(draft), draft_backend=DRAFT)
    runs.append(
        {"name": "seed", "backend": TARGET, "model": small, "passes": 2, "engine_args": spec, "env": SPECULATIVE_ENV}
    )
    runs.append({"name": "tp2", "backend": TARGET, "model": small, "engine_args": {"tp_size": 2}, "env": RANK_CPUS})
    runs.append({"name": "batched", "backend": BATCHED, "model": small, "passes": 2})
    runs.append({"name": "refused", "backend": DRAFT, "model": small})  # last: a refused start ends its driver
    done = run_engines(
        models["latent32"].path,
        tiny_model.prompts,
        NEW_TOKENS,
        runs,
        tmp_path_factory.mktemp("mla-probes"),
        env=PROBE_TARGETS,
        timeout=1500,
    )
    return MLARuns(models, done)


def _ok(runs: MLARuns, name: str) -> dict[str, Any]:
    result = runs.runs.results[name]
    assert "error" not in result, f"sglang.Engine, MLA run {name!r}, failed:\n{result['error']}"
    assert result["children_left"] == [], f"Engine.shutdown() left processes behind: {result['children_left']}"
    return result


def _runners(records: list[dict[str, Any]]) -> dict[bool, list[dict[str, Any]]]:
    runners = [r for r in records if r["event"] == "runner"]
    return {draft: [r for r in runners if r["is_draft_worker"] == draft] for draft in (False, True)}


def _ran(records: list[dict[str, Any]], runner: dict[str, Any]) -> set[tuple[str, str, str | None]]:
    """(backend class, method, mode) of every forward record of *runner*."""
    return {
        (r["backend_class"], r["method"], r["mode"])
        for r in records
        if r["event"] == "forward" and r["runner"] == runner["runner"] and r["pid"] == runner["pid"]
    }


def _stamped(runner: dict[str, Any], name: str) -> bool:
    stamps = (
        "prefill_attention_backend_str",
        "decode_attention_backend_str",
        "backend_prefill_str",
        "backend_decode_str",
    )
    return all(runner[stamp] == name for stamp in stamps)


@pytest.mark.parametrize("run", list(PLAIN_RUNS))
def test_greedy_ids_equal_hf_also_from_the_prefix_cache(run: str, mla_runs: MLARuns) -> None:
    shape, backend, code = PLAIN_RUNS[run]
    result, model = _ok(mla_runs, run), mla_runs.models[shape]
    assert result["output_ids"] == model.hf_ids
    [second] = result["later_passes"]
    assert second["output_ids"] == model.hf_ids
    assert all(meta["cached_tokens"] > 0 for meta in second["meta_info"]), second["meta_info"]  # the radix cache hit

    records = read_probe(mla_runs.runs.probes[run])
    [target] = _runners(records)[False]
    assert target["backend_class"] == MLA_ADAPTER and _stamped(target, backend), target
    ran = _ran(records, target)
    assert (code, "forward_mla_mha", "EXTEND") in ran, ran  # the first prefill: no cached prefix
    assert (code, "forward_mla_mqa", "EXTEND") in ran, ran  # the second: over the cached prefix
    assert (code, "forward_mla_mqa", "DECODE") in ran, ran
    assert not {method for cls, method, _ in ran if cls == code} & {"forward_extend", "forward_decode"}, ran
    assert {cls for cls, _, _ in ran if cls in (TORCH_NATIVE, TINY, BATCHED_CODE)} == {code}, ran  # no other's code


def test_mla_target_and_dense_draft_on_two_attnhost_backends(mla_runs: MLARuns) -> None:
    """SGLang #28559's scenario: the draft's backend never becomes the target's."""
    result, plain = _ok(mla_runs, "seed"), _ok(mla_runs, "latent32")
    assert result["output_ids"] == plain["output_ids"] == mla_runs.models["latent32"].hf_ids
    [second] = result["later_passes"]
    assert second["output_ids"] == plain["output_ids"]
    for meta in result["meta_info"] + second["meta_info"]:
        assert meta.get("spec_verify_ct", 0) > 0, meta
    assert all(meta["cached_tokens"] > 0 for meta in second["meta_info"]), second["meta_info"]

    records = read_probe(mla_runs.runs.probes["seed"])
    runners = _runners(records)
    [target], [draft] = runners[False], runners[True]
    assert target["backend_class"] == MLA_ADAPTER and _stamped(target, TARGET), target
    assert draft["backend_class"] == ADAPTER and _stamped(draft, DRAFT), draft
    drafting = [r for r in records if r["event"] == "draft_backends"]
    assert drafting and all(
        part["stamp"] == DRAFT for r in drafting for part in (r["decode"], r["draft_extend"]) if part
    ), drafting

    target_ran = _ran(records, target)
    attnhost_code = {(cls, method, mode) for cls, method, mode in target_ran if cls in (TORCH_NATIVE, TINY)}
    assert {cls for cls, _, _ in attnhost_code} == {TORCH_NATIVE}, target_ran  # never the draft's code
    assert {method for _, method, _ in attnhost_code} <= {"forward_mla_mha", "forward_mla_mqa"}, target_ran
    assert (TORCH_NATIVE, "forward_mla_mqa", "TARGET_VERIFY") in attnhost_code, target_ran
    assert (TORCH_NATIVE, "forward_mla_mha", "EXTEND") in attnhost_code, target_ran
    adapters = {cls for cls, _, _ in target_ran if cls not in (TORCH_NATIVE, TINY)}
    assert adapters == {MLA_ADAPTER}, target_ran
    # every forward mode the target's adapter was planned for reached torch_native's MLA code
    planned = {mode for _, _, mode in target_ran if mode is not None}
    assert planned <= {mode for _, _, mode in attnhost_code}, target_ran

    draft_ran = _ran(records, draft)
    draft_code = {(cls, mode) for cls, _, mode in draft_ran if cls in (TORCH_NATIVE, TINY)}
    assert {cls for cls, _ in draft_code} == {TINY}, draft_ran
    assert {"EXTEND", "DRAFT_EXTEND_V2"} <= {mode for _, mode in draft_code}, draft_ran
    assert "DECODE" in {r["mode"] for r in records if r["event"] == "forward" and r["backend_class"] == TINY}


def test_tp2_ids_equal_tp1(mla_runs: MLARuns) -> None:
    result, plain = _ok(mla_runs, "tp2"), _ok(mla_runs, "latent32")
    assert result["output_ids"] == plain["output_ids"]
    records = read_probe(mla_runs.runs.probes["tp2"])
    ranks = {r["pid"] for r in records if r["event"] == "runner" and r["backend_class"] == MLA_ADAPTER}
    assert len(ranks) == 2, f"the MLA adapter ran in {len(ranks)} rank process(es), not 2: {records}"
    assert {
        (r["method"], r["mode"]) for r in records if r["event"] == "forward" and r["backend_class"] == TORCH_NATIVE
    } >= {
        ("forward_mla_mha", "EXTEND"),
        ("forward_mla_mqa", "DECODE"),
    }


def test_a_backend_without_mla_is_refused_by_name_when_the_model_loads(mla_runs: MLARuns) -> None:
    error = mla_runs.runs.results["refused"].get("error", "")
    assert error, "an MLA model started on 'tiny', which does not declare mla"
    [line] = [line for line in error.splitlines() if "BackendCapabilities.mla" in line][-1:]
    assert "attnhost backend 'tiny'" in line and "DeepseekV2ForCausalLM" in line, line
    assert str(mla_runs.models["latent32"].path) in line and "kv_lora_rank 32" in line, line
    assert "attnhost_torch_native" in line, line  # the way out


def test_mla_drivers_left_nothing_behind(mla_runs: MLARuns) -> None:
    for done in mla_runs.runs.drivers:
        assert done.leftover == "none"
