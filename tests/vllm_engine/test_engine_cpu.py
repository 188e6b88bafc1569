"""attnhost backends in real vLLM V1 engines on this CPU: HF's ids, the served ids, rank agreement.

* the examples (``tiny``, ``batched_matmul`` and the compiled ``cpu_paged``) in ``LLM.generate``: greedy ids
  equal to HF transformers' over prefill, chunked prefill batched with decodes, decode and a prefix-cached
  second pass, each engine in turn in one driver process, their decode steps on the adapter's persistent uniform
  batches (all three declare graph support: these are the batches vLLM's CUDA graphs capture and replay on a
  GPU); then ``batched_matmul`` and ``cpu_paged`` again with vLLM's own compilation on (what its CPU platform does
  unless ``enforce_eager``: the model traced by ``torch.compile``, attention between its pieces), and EAGLE
  speculative decoding with ``batched_matmul`` as target and drafter (its verify and draft steps on uniform
  batches too), the same ids;
* vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with
  ``--attention-backend`` naming the compiled example: a ``/v1/completions`` request with token-id prompts
  returns HF's greedy ids, the probe shows the example ran prefill, mixed and decode batches in the server's
  processes, and nothing of the server is left running once it is stopped;
* a rank that lacks the example plugins (``ATTNHOST_DISABLE_PLUGIN_AUTOLOAD=1`` on rank 1 only) stops a
  ``tensor_parallel_size=2`` engine with attnhost's rank-mismatch error, in bounded time, nothing left running.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("attnhost_vllm_engine_cpu", reason="the test-only vLLM CPU engine kit is not installed")

from attnhost_vllm_engine_cpu.engines import (
    IN_PROCESS,
    Models,
    batches_seen,
    generate_run,
    paths_seen,
    run_engines,
    speculative_run,
)
from attnhost_vllm_engine_cpu.ranks import RANK_ENV
from attnhost_vllm_engine_cpu.serve import serve_completions

from attnhost.engines.vllm.names import vllm_name

EXAMPLES = ("tiny", "batched_matmul", "cpu_paged")
COMPILED = ("batched_matmul", "cpu_paged")
"""The examples also run with vLLM's compilation on (all three declare ``cuda_graph``)."""
SERVED = "cpu_paged"  # the compiled example: a kernel built outside Python, as a vendor's would be
MISMATCH_BOUND = 600  # seconds: two ranks import vLLM, load the model and meet at the check, on shared cores


def test_examples_generate_hf_greedy_ids(models: Models, tmp_path: Path) -> None:
    """One of the slow tests: each example's engine, eager and compiled, and EAGLE on one, in one driver process
    (engine configurations no other test starts)."""
    runs = [generate_run(models, vllm_name(name)) for name in EXAMPLES]
    runs += [generate_run(models, vllm_name(name), enforce_eager=False) for name in COMPILED]
    speculative = vllm_name("batched_matmul")
    runs.append(speculative_run(models, "eagle", speculative, speculative))
    outcome = run_engines(models.target, runs, tmp_path, **IN_PROCESS)  # single-rank: engine cores in the driver
    for i, name in enumerate(EXAMPLES + COMPILED):
        compiled = i >= len(EXAMPLES)
        what = f"LLM.generate with attnhost backend {name!r}{' and compilation on' if compiled else ''}"
        result = outcome.result(i, what)
        assert result["passes"] == [models.hf_ids, models.hf_second], (
            f"{what}: greedy ids {result['passes']} differ from HF's {[models.hf_ids, models.hf_second]}"
        )
        seen = paths_seen(outcome.records[i], name)
        assert {(False, "EXTEND"), (False, "MIXED"), (False, "DECODE")} <= seen, f"{what}: ran {sorted(seen)}"
        assert any(b["extend_with_prefix"] for b in batches_seen(outcome.records[i], name)), what
        assert result["counters"]["vllm:prefix_cache_hits"] > 0, result["counters"]
        # each declares cuda_graph: its decode steps run on the persistent batches vLLM's CUDA graphs would replay
        uniform = {b["mode"] for b in batches_seen(outcome.records[i], name) if b["uniform"]}
        assert uniform == {"DECODE"}, f"{what}: uniform batches {uniform}"
    eagle = outcome.result(len(runs) - 1, "EAGLE speculative decoding with batched_matmul as target and drafter")
    assert eagle["passes"] == [models.hf_ids], f"EAGLE with batched_matmul: {eagle['passes']} differ from HF's"
    seen = {(b["draft"], b["mode"]) for b in batches_seen(outcome.records[-1], "batched_matmul") if b["uniform"]}
    assert {(False, "EXTEND"), (True, "DECODE")} <= seen, f"EAGLE with batched_matmul: uniform batches {seen}"
    assert not outcome.left_running, outcome.left_running


def test_openai_server_serves_hf_greedy_ids(models: Models, tmp_path: Path) -> None:
    served = serve_completions(models.target, vllm_name(SERVED), models.prompts, tmp_path)
    ids = served.completions(f"vllm.entrypoints.openai.api_server with attnhost backend {SERVED!r}")
    assert ids == models.hf_ids, f"{SERVED}: served token ids {ids} differ from HF's {models.hf_ids}"
    forwards = [r for r in served.records if r["event"] == "forward" and r["backend"] == SERVED]
    assert forwards, f"{SERVED}: the probe saw no attnhost forward in the server: {served.records}"
    outside = {r["pid"] for r in forwards} - served.server_pids
    assert not outside, f"{SERVED}: forwards in processes {outside}, not the server's {served.server_pids}"
    seen = paths_seen(served.records, SERVED)
    assert {(False, "EXTEND"), (False, "MIXED"), (False, "DECODE")} <= seen, f"{SERVED}: ran {sorted(seen)}"
    assert not served.left_running, f"processes left running: {served.left_running}"


def test_rank_lacking_plugins_stops_the_engine(models: Models, tmp_path: Path) -> None:
    run = generate_run(models, "TORCH_NATIVE", tensor_parallel_size=2, distributed_executor_backend="mp")
    rank1 = json.dumps({"1": {"ATTNHOST_DISABLE_PLUGIN_AUTOLOAD": "1"}})
    outcome = run_engines(models.target, [run], tmp_path, timeout=MISMATCH_BOUND, **{RANK_ENV: rank1})
    assert not outcome.timed_out, f"the engine did not stop within {MISMATCH_BOUND} s"
    assert outcome.results and "error" in outcome.results[0], f"the engine started: {outcome.results}"
    # the worker's RankMismatchError as vLLM reports it: in the engine core's log, and in the error where the
    # engine core runs in the driver's process
    error = outcome.results[0]["error"] + outcome.output
    assert "attention plugins or backends differ across ranks" in error, error[-3000:]
    assert "is blocked on rank 1 but loaded on rank 0" in error and "backends missing" in error, error[-3000:]
    assert not outcome.left_running, f"processes left running: {outcome.left_running}"
