"""Sliding windows, logit soft-caps and attention sinks in a real ``sglang.Engine`` on the CPU, attention by attnhost:
tiny random Gemma 2 (soft-cap 5 + alternating window), Gemma 3 (window) and gpt-oss (sinks + window, MoE) models made
locally (``attnhost_sglang_cpu.variant_models``), prompts longer than the window, greedy ids equal HF transformers'
(eager), also on a second, prefix-cached pass. Building each model checks in HF that switching each of its features off
changes the ids, so an engine that ignored one could not pass.

All runs go through one engine driver, one engine per (model, backend), every check of that pair on its one run:

* each model on ``attnhost_torch_native`` and on the example plugin's ``batched_matmul``;
* gpt-oss once more with ``disable_hybrid_swa_memory``: SGLang then keeps the window layers' keys in the ordinary
  pool, whereas by default it builds its hybrid ``SWAKVPool`` and the adapter serves the window layers from the
  window part through a second backend over translated slots (the probe sees both pools and both backends);
* a speculative chain (STANDALONE, the draft a copy of the target) on Gemma 2, target and draft on torch_native:
  windows and caps in the target's verify and the draft's extend and decode steps;
* a tiny Mistral whose config declares a window SGLang's model code drops (one that changes HF's ids): one
  start-up warning per runner;
* two refusals by name, never a killed process: gpt-oss on ``tiny`` (no sinks, no window) when SGLang resolves its
  arguments, and Gemma 2 on ``tiny`` when the model loads, each raised to the caller of ``sglang.Engine``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from attnhost_sglang_cpu import SPECULATIVE_ENV
from attnhost_sglang_cpu import variant_models as vm
from attnhost_sglang_cpu.e2e import ADAPTER, EngineRuns, TinyModel, read_probe, run_engines
from attnhost_sglang_cpu.run_engine import speculative_args
from attnhost_sglang_cpu.tiny_model import build_draft_model
from conftest import NEW_TOKENS

TORCH_NATIVE, BATCHED, TINY = "attnhost_torch_native", "batched_matmul", "tiny"
TORCH_NATIVE_CODE = "attnhost_builtin.torch_native.TorchNativeAttnBackend"
BATCHED_CODE = "attnhost_batched.backend.BatchedMatmulAttnBackend"
PROBE_TARGETS = {
    "ATTNHOST_TEST_PROBE_TARGETS": "attnhost_builtin.torch_native:TorchNativeAttnBackend,"
    "attnhost_batched.backend:BatchedMatmulAttnBackend",
    **SPECULATIVE_ENV,  # gpt-oss's MoE and the speculative worker launch triton kernels: interpreted here
}
SWA_POOL = "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool"
# run name -> (model, backend, the attnhost class whose code must have run, extra engine arguments)
PLAIN_RUNS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "gemma2": ("gemma2", TORCH_NATIVE, TORCH_NATIVE_CODE, {}),
    "gemma2-batched": ("gemma2", BATCHED, BATCHED_CODE, {}),
    "gemma3": ("gemma3", TORCH_NATIVE, TORCH_NATIVE_CODE, {}),
    "gemma3-batched": ("gemma3", BATCHED, BATCHED_CODE, {}),
    "gpt_oss": ("gpt_oss", TORCH_NATIVE, TORCH_NATIVE_CODE, {}),
    "gpt_oss-batched": ("gpt_oss", BATCHED, BATCHED_CODE, {}),
    "gpt_oss-one-pool": ("gpt_oss", TORCH_NATIVE, TORCH_NATIVE_CODE, {"disable_hybrid_swa_memory": True}),
}


@dataclass(frozen=True)
class VariantRuns:
    models: dict[str, TinyModel]
    runs: EngineRuns


@pytest.fixture(scope="module")
def variant_runs(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> VariantRuns:
    """The variant models' engines (Gemma 2, Gemma 3, gpt-oss, Mistral; plain, paged and speculative), one after
    another in one driver process: one of the slow set-ups, engine configurations no other test starts."""
    models = {
        kind: vm.prepare_variant_model(
            kind, tmp_path_factory.mktemp(f"tiny-{kind}"), NEW_TOKENS, tokenizer_from=tiny_model.path
        )
        for kind in vm.VARIANT_MODELS
    }
    mistral = tmp_path_factory.mktemp("tiny-mistral")
    vm.build_variant_model("mistral", mistral, tokenizer_from=tiny_model.path)
    prompts = vm.variant_prompt_ids(mistral)
    mistral_hf = vm.hf_greedy_each(mistral, prompts, NEW_TOKENS)
    mistral_without = vm.hf_greedy_without(mistral, prompts, NEW_TOKENS, "sliding_window")
    assert mistral_hf != mistral_without, "the tiny Mistral's window does not change HF's ids: nothing to warn about"
    draft = tmp_path_factory.mktemp("gemma2-draft")
    build_draft_model(draft, models["gemma2"].path, copy_of_target=True)

    runs: list[dict[str, Any]] = [
        {
            "name": name,
            "backend": backend,
            "model": str(models[kind].path),
            "prompts": models[kind].prompts,
            "passes": 2,
            "engine_args": args,
        }
        for name, (kind, backend, _, args) in PLAIN_RUNS.items()
    ]
    gemma2 = models["gemma2"]
    runs.append(
        {
            "name": "gemma2-spec",
            "backend": TORCH_NATIVE,
            "model": str(gemma2.path),
            "prompts": gemma2.prompts,
            "passes": 2,
            "engine_args": speculative_args(str(draft), draft_backend=TORCH_NATIVE),
        }
    )
    runs.append(
        {
            "name": "mistral",
            "backend": TORCH_NATIVE,
            "model": str(mistral),
            "prompts": prompts,
            "engine_args": {"log_level": "warning"},
        }
    )
    gpt_oss = models["gpt_oss"]
    runs.append({"name": "gpt_oss-tiny", "backend": TINY, "model": str(gpt_oss.path), "prompts": gpt_oss.prompts})
    # last: a start refused in the scheduler ends its driver
    runs.append({"name": "gemma2-tiny", "backend": TINY, "model": str(gemma2.path), "prompts": gemma2.prompts})
    done = run_engines(
        gemma2.path,
        gemma2.prompts,
        NEW_TOKENS,
        runs,
        tmp_path_factory.mktemp("variant-probes"),
        env=PROBE_TARGETS,
        timeout=1800,
    )
    return VariantRuns(models, done)


def _ok(runs: VariantRuns, name: str) -> dict[str, Any]:
    result = runs.runs.results[name]
    assert "error" not in result, f"sglang.Engine, variant run {name!r}, failed:\n{result['error']}"
    assert result["children_left"] == [], f"Engine.shutdown() left processes behind: {result['children_left']}"
    return result


def _target(records: list[dict[str, Any]]) -> dict[str, Any]:
    [target] = [r for r in records if r["event"] == "runner" and not r["is_draft_worker"]]
    return target


def _code_backends(records: list[dict[str, Any]], runner: dict[str, Any], code: str) -> dict[int, set[str]]:
    """The attnhost backend objects of class *code* that ran forwards for *runner*, with the modes each ran."""
    seen: dict[int, set[str]] = {}
    for r in records:
        if r["event"] == "forward" and r["runner"] == runner["runner"] and r["backend_class"] == code:
            seen.setdefault(r["backend"], set()).add(r["mode"])
    return seen


@pytest.mark.parametrize("run", list(PLAIN_RUNS))
def test_greedy_ids_equal_hf_also_from_the_prefix_cache(run: str, variant_runs: VariantRuns) -> None:
    kind, backend, code, args = PLAIN_RUNS[run]
    result, model = _ok(variant_runs, run), variant_runs.models[kind]
    assert result["output_ids"] == model.hf_ids, f"{run}: SGLang's ids differ from HF's"
    [second] = result["later_passes"]
    assert second["output_ids"] == model.hf_ids, f"{run}: the prefix-cached pass's ids differ from HF's"
    assert all(meta["cached_tokens"] > 0 for meta in second["meta_info"]), second["meta_info"]
    assert all(len(p) > 2 * vm.WINDOW for p in model.prompts), [len(p) for p in model.prompts]

    records = read_probe(variant_runs.runs.probes[run])
    target = _target(records)
    assert target["backend_class"] == ADAPTER and target["prefill_attention_backend_str"] == backend, target
    ran = _code_backends(records, target, code)
    assert {"EXTEND", "DECODE"} <= set().union(*ran.values()), ran
    hybrid = kind == "gpt_oss" and not args.get("disable_hybrid_swa_memory")
    assert (target["kv_pool_class"] == SWA_POOL) == hybrid, target
    # the hybrid pool's window layers run on a second backend of the same plugin, over the window part
    assert len(ran) == (2 if hybrid else 1), ran


def test_speculative_chain_with_windows_and_caps(variant_runs: VariantRuns) -> None:
    result, model = _ok(variant_runs, "gemma2-spec"), variant_runs.models["gemma2"]
    assert result["output_ids"] == model.hf_ids
    [second] = result["later_passes"]
    assert second["output_ids"] == model.hf_ids
    for meta in result["meta_info"] + second["meta_info"]:
        assert meta.get("spec_verify_ct", 0) > 0, meta
    records = read_probe(variant_runs.runs.probes["gemma2-spec"])
    modes = {
        (r["is_draft_worker"], r["mode"])
        for r in records
        if r["event"] == "forward" and r["backend_class"] == TORCH_NATIVE_CODE
    }
    assert {(False, "TARGET_VERIFY"), (True, "DRAFT_EXTEND_V2"), (True, "DECODE")} <= modes, modes


def test_a_window_sglang_drops_is_warned_once_per_runner(variant_runs: VariantRuns) -> None:
    _ok(variant_runs, "mistral")
    stderr = "".join(done.stderr for done in variant_runs.runs.drivers)
    warnings = [line for line in stderr.splitlines() if "declares sliding_window=" in line]
    assert len(warnings) == 1, warnings
    assert "MistralForCausalLM" in warnings[0] and f"sliding_window={vm.WINDOW}" in warnings[0], warnings


def test_gpt_oss_on_a_backend_without_sinks_is_refused_by_name_at_argument_resolution(
    variant_runs: VariantRuns,
) -> None:
    error = variant_runs.runs.results["gpt_oss-tiny"].get("error", "")
    assert error, "gpt-oss started on 'tiny', which declares neither sinks nor sliding_window"
    [line] = [line for line in error.splitlines() if "cannot serve GptOssForCausalLM" in line][-1:]
    assert "attnhost backend 'tiny'" in line and "does not declare sinks, sliding_window" in line, line
    assert TORCH_NATIVE in line and BATCHED in line, line  # the way out
    assert "UnsupportedFeatureError" in error and "exit status" not in error, error  # raised, not a killed driver


def test_gemma2_on_a_backend_without_windows_is_refused_by_name_when_the_model_loads(
    variant_runs: VariantRuns,
) -> None:
    error = variant_runs.runs.results["gemma2-tiny"].get("error", "")
    assert error, "Gemma 2 started on 'tiny', which declares no sliding_window and no logit_cap"
    [line] = [line for line in error.splitlines() if "cannot serve Gemma2ForCausalLM" in line][-1:]
    assert "attnhost backend 'tiny'" in line and str(variant_runs.models["gemma2"].path) in line, line
    assert f"layer 0 needs sliding-window attention (sliding_window_size={vm.WINDOW - 1};" in line, line
    assert "it does not declare sliding_window" in line and TORCH_NATIVE in line, line


def test_variant_drivers_left_nothing_behind(variant_runs: VariantRuns) -> None:
    for done in variant_runs.runs.drivers:
        assert done.leftover == "none"
