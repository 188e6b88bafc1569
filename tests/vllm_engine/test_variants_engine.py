"""Attention variants in a real vLLM engine on this CPU: soft-caps, sliding windows and sinks on attnhost backends.

A tiny random Gemma 2 (logit soft-cap on every layer, a window on every other one) runs on the built-in
``torch_native`` and on the ``batched_matmul`` example, and a tiny random gpt-oss (sinks on every layer, a window
on every other one, MoE) on ``torch_native``: ``LLM.generate`` over prompts many windows long, then a
prefix-cached second pass, returns HF transformers' greedy ids (eager attention), which HF itself changes when
any of those features is switched off (:func:`attnhost_vllm_engine_cpu.variant_models.prepare` asserts it). The
``tiny`` example declares none of them: vLLM refuses the Gemma 2 with it while building the model, with
attnhost's one sentence naming the backend and the feature. All engines share one driver process (one import
of vLLM), each with vLLM's engine core in that process (single-rank runs: no engine core process importing vLLM
again).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("attnhost_vllm_engine_cpu", reason="the test-only vLLM CPU engine kit is not installed")

from attnhost_vllm_engine_cpu.engines import IN_PROCESS, NEW_TOKENS, batches_seen, paths_seen, run_engines
from attnhost_vllm_engine_cpu.variant_models import VariantModel, prepare, variant_run

from attnhost.engines.vllm.names import vllm_name

#: (model, attnhost backend) pairs that must return HF's ids; the backends declare every feature of the model.
SERVED = (("gemma2", "torch_native"), ("gemma2", "batched_matmul"), ("gpt_oss", "torch_native"))
REFUSING = "tiny"  # declares no variant
REFUSAL = re.compile(
    r"UnsupportedFeatureError: (attnhost backend 'tiny' [^\n]*?does not support sliding-window attention [^\n]*?"
    r"it does not declare sliding_window[^\n]*; choose another --attention-backend)"
)


def test_variant_models_generate_hf_greedy_ids(tmp_path: Path) -> None:
    models: dict[str, VariantModel] = {
        kind: prepare(kind, tmp_path / kind, NEW_TOKENS) for kind in ("gemma2", "gpt_oss")
    }
    runs = [variant_run(models[kind], vllm_name(backend), NEW_TOKENS) for kind, backend in SERVED]
    # the refused engine between served ones: a refusal stops that engine only
    runs.insert(1, variant_run(models["gemma2"], vllm_name(REFUSING), NEW_TOKENS))
    served = [0, 2, 3]
    outcome = run_engines(models["gemma2"].path, runs, tmp_path / "engines", **IN_PROCESS)

    for index, (kind, backend) in zip(served, SERVED, strict=True):
        model = models[kind]
        result = outcome.result(index, f"LLM.generate of the tiny {kind} with attnhost backend {backend!r}")
        assert result["passes"] == [model.hf_ids, model.hf_second], (
            f"{kind} on {backend}: greedy ids {result['passes']} differ from HF's {[model.hf_ids, model.hf_second]}"
        )
        # every attention layer, windowed or not, runs on the backend vLLM was given (the kit's platform answers
        # it for all of them); the ids above are what show the window, cap and sinks were applied
        seen = paths_seen(outcome.records[index], backend)
        assert {(False, "EXTEND"), (False, "MIXED"), (False, "DECODE")} <= seen, f"{kind} on {backend}: ran {seen}"
        assert any(b["extend_with_prefix"] for b in batches_seen(outcome.records[index], backend)), (kind, backend)
        assert result["counters"]["vllm:prefix_cache_hits"] > 0, result["counters"]

    assert len(outcome.results) > 1 and "error" in outcome.results[1], f"{REFUSING} was not refused: {outcome.results}"
    assert "passes" not in outcome.results[1], outcome.results[1]
    assert not paths_seen(outcome.records[1], REFUSING), "the refused backend ran a forward"
    found = REFUSAL.search(outcome.results[1]["error"] + outcome.output)
    assert found, f"no attnhost refusal naming {REFUSING!r} and the window:\n{outcome.output[-4000:]}"
    assert "in model " in found.group(1) and "logits_soft_cap=5.0" in found.group(1), found.group(1)
    assert not outcome.left_running, outcome.left_running
