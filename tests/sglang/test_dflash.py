"""DFLASH in a real ``sglang.Engine`` on the CPU, target and draft on attnhost backends.

SGLang's DFLASH worker drafts a block at once with a DFlash draft
(``sglang.srt.models.dflash``): the bonus token and mask tokens, attending to
each other and to K/V made from the target's hidden states, non-causally by
default, causally with ``is_causal: true``, within a window on
``sliding_attention`` layers. The kit builds tiny random drafts of each kind
(``attnhost_sglang_cpu.dflash_model``) and the scaffolding DFLASH needs on this
CPU (``attnhost_sglang_cpu.dflash_plugin``).

The oracles, per engine run:

* the target's greedy ids equal HF transformers' (a greedy target's ids never
  depend on the draft), and verification ran (``spec_verify_ct > 0``);
* every verify block the target ran (the bonus token and the draft's
  proposals) equals what a float64 reading of the draft's definition proposes
  (``reference_verify_rows``, from HF's hidden states): the draft's attention
  computed right, not merely harmlessly. SGLang's own ``triton`` run proves that
  reference is SGLang's semantics; switching each variant off changes the
  proposals, so the comparison can tell them apart;
* the probe: each runner's backend class and name stamps, and the draft's
  forward modes (a DFlash draft runs only ``TARGET_VERIFY`` batches: its
  context K/V are written without attention).

Point 4 (the fallback rule inside DFLASH, which settles its draft backend while
SGLang resolves the arguments) is shown without an engine, on SGLang's own
argument resolution and draft-worker resolver, and inside an engine (the
``fallback`` run, with a probe on ``resolve_draft_worker_attention_backend``).
Point 5: the MLA target (a tiny DeepSeek-V2) hands its hidden states to a
DFlash draft on this CPU (the ``mla`` run).

One engine per configuration, all in one driver process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from attnhost_sglang_cpu import SPECULATIVE_ENV, sglang_env
from attnhost_sglang_cpu import dflash_model as dm
from attnhost_sglang_cpu import tiny_model as tm
from attnhost_sglang_cpu.dflash_plugin import resolver_calls, verify_rows
from attnhost_sglang_cpu.e2e import (
    ADAPTER,
    MLA_ADAPTER,
    SGLANG_TRITON,
    EngineRuns,
    TinyModel,
    read_probe,
    run_engines,
    speculative_summary,
)
from attnhost_sglang_cpu.run_engine import speculative_args
from conftest import NEW_TOKENS
from distgen import make_dist

#: A third-party plugin: ``acme_target`` is a target-only backend; acme lets attnhost's ``torch_native`` draft and
#: names it as this platform's draft fallback (unless ``ACME_DFLASH_FALLBACK`` says otherwise, empty: none).
ACME = '''
"""acme-dflash: a target-only backend; torch_native drafts, and is the CPU draft fallback (test plugin)."""
import os

from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [BackendSpec(name="acme_target", factory="attnhost_builtin.torch_native:TorchNativeAttnBackend",
                        platforms=("cpu",), requires=("torch",), description="acme, target only")]


@hookimpl
def attnhost_draft_attention_backends():
    return ["torch_native"]


@hookimpl
def attnhost_draft_fallback(platform):
    return (os.environ.get("ACME_DFLASH_FALLBACK", "torch_native") or None) if platform == "cpu" else None
'''

TORCH_NATIVE = "attnhost_torch_native"
BATCHED = "batched_matmul"
PROBE_TARGETS = {
    "ATTNHOST_TEST_PROBE_TARGETS": "attnhost_builtin.torch_native:TorchNativeAttnBackend,"
    "attnhost_batched.backend:BatchedMatmulAttnBackend"
}
SGLANG_FALLBACK_WARNING = (
    "DFLASH draft worker does not support attention_backend 'acme_target' on AttnhostTestCpuPlatform. "
    "Falling back to 'attnhost_torch_native'."
)


@dataclass(frozen=True)
class DFlashCase:
    name: str
    target: str  # --attention-backend
    kind: str  # the DFlash draft (dflash_model.DRAFT_KINDS)
    draft_backend: str | None = None  # --speculative-draft-attention-backend; None: SGLang's resolution decides
    drafts_on: str = ""  # the backend the draft must run on
    model: str = "llama"  # the target: "llama", or "deepseek" (MLA)
    target_class: str = ADAPTER
    draft_class: str = ADAPTER
    draft_code: str | None = None  # the attnhost backend class (``NAME`` of ``NAMEAttnBackend``) the draft ran


CASES = [
    # SGLang's own backend, target and draft: proves the kit's scaffolding and the reference
    DFlashCase(
        "triton", "triton", "sliding", drafts_on="triton", target_class=SGLANG_TRITON, draft_class=SGLANG_TRITON
    ),
    # a target that cannot draft, none named: acme's attnhost_draft_fallback decides (a window and non-causal layer)
    DFlashCase("fallback", "acme_target", "sliding", drafts_on=TORCH_NATIVE, draft_code="TorchNative"),
    # the default, non-causal DFlash draft on the example plugin's backend, named
    DFlashCase("batched", TORCH_NATIVE, "noncausal", BATCHED, drafts_on=BATCHED, draft_code="BatchedMatmul"),
    # point 5: an MLA target with a DFlash draft (is_causal: true), both on attnhost's torch_native
    DFlashCase(
        "mla", TORCH_NATIVE, "causal", TORCH_NATIVE, TORCH_NATIVE, "deepseek", MLA_ADAPTER, ADAPTER, "TorchNative"
    ),
]


@dataclass(frozen=True)
class DFlashRuns:
    models: dict[str, TinyModel]
    drafts: dict[str, Path]
    site: Path
    runs: EngineRuns


def _acme_site(root: Path) -> Path:
    make_dist(
        root,
        "acme-dflash",
        "1.0",
        {"sglang.draft_attention_backends": {"acme_dflash": "acme_dflash"}},
        modules={"acme_dflash": ACME},
    )
    return root


@pytest.fixture(scope="module")
def dflash(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> DFlashRuns:
    """Every DFLASH case's engine (each draft kind, target and draft backend), one after another in one driver
    process: one of the slow set-ups, engine configurations no other test starts."""
    deepseek = tmp_path_factory.mktemp("tiny-deepseek")
    tm.build_deepseek_model(deepseek, kv_lora_rank=32, qk_rope_head_dim=16, tokenizer_from=tiny_model.path)
    models = {
        "llama": tiny_model,
        "deepseek": TinyModel(deepseek, tiny_model.prompts, tm.hf_greedy(deepseek, tiny_model.prompts, NEW_TOKENS)),
    }
    drafts = {}
    for kind in sorted({case.kind for case in CASES}):
        drafts[kind] = tmp_path_factory.mktemp(f"dflash-{kind}")
        dm.build_dflash_draft(drafts[kind], tiny_model.path, dm.DRAFT_KINDS[kind])
    site = _acme_site(tmp_path_factory.mktemp("acme-dflash-site"))
    runs = []
    for case in CASES:
        args = speculative_args(
            str(drafts[case.kind]),
            algorithm="DFLASH",
            num_steps=1,
            num_draft_tokens=dm.BLOCK_SIZE,
            draft_backend=case.draft_backend,
        )
        args["log_level"] = "warning"  # SGLang's fallback warning must reach stderr
        runs.append(
            {
                "name": case.name,
                "backend": case.target,
                "model": str(models[case.model].path),
                "engine_args": args,
                "env": PROBE_TARGETS,
            }
        )
    done = run_engines(
        tiny_model.path,
        tiny_model.prompts,
        NEW_TOKENS,
        runs,
        tmp_path_factory.mktemp("dflash-probes"),
        env=SPECULATIVE_ENV,
        path_entries=[str(site)],
        timeout=1500,
    )
    return DFlashRuns(models, drafts, site, done)


def _result(dflash: DFlashRuns, case: DFlashCase) -> dict[str, Any]:
    result = dflash.runs.results[case.name]
    assert "error" not in result, f"sglang.Engine, DFLASH {case.name}, failed:\n{result['error']}"
    return result


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_dflash_target_ids_equal_hf_and_the_draft_proposes_what_its_definition_says(
    case: DFlashCase, dflash: DFlashRuns
) -> None:
    result = _result(dflash, case)
    model = dflash.models[case.model]
    assert result["output_ids"] == model.hf_ids
    assert all(meta.get("spec_verify_ct", 0) > 0 for meta in result["meta_info"]), result["meta_info"]
    expected = dm.reference_verify_rows(
        model.path, dflash.drafts[case.kind], dm.DRAFT_KINDS[case.kind], model.prompts, model.hf_ids
    )
    ran = verify_rows(read_probe(dflash.runs.probes[case.name]))
    # rows of different requests interleave in a batch: compare as multisets of (committed length, block)
    assert Counter(_key(row) for row in ran) == Counter(_key(row) for rows in expected for row in rows), (ran, expected)
    assert result["children_left"] == [], f"Engine.shutdown() left processes behind: {result['children_left']}"


def _key(row: tuple[int, list[int]]) -> tuple[int, tuple[int, ...]]:
    return row[0], tuple(row[1])


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_dflash_probe_shows_each_runners_backend_and_the_drafts_forward_modes(
    case: DFlashCase, dflash: DFlashRuns
) -> None:
    _result(dflash, case)
    records = read_probe(dflash.runs.probes[case.name])
    seen = speculative_summary(records)
    assert seen["target_class"] == [case.target_class], seen
    assert seen["draft_class"] == [case.draft_class], seen
    runners = {r["is_draft_worker"]: r for r in records if r["event"] == "runner"}
    for runner, name in ((runners[False], case.target), (runners[True], case.drafts_on)):
        assert runner["prefill_attention_backend_str"] == runner["decode_attention_backend_str"] == name, runner
    assert {"EXTEND", "TARGET_VERIFY"} <= seen["modes"]["target"], seen
    # the draft runs its block only; its context K/V from the target's hidden states are written without attention
    assert seen["modes"]["draft"] == {"TARGET_VERIFY"}, seen
    if case.draft_code is not None:  # the plugin backend's own code ran for the draft runner
        code = {
            r["backend_class"].rsplit(".", 1)[-1]
            for r in records
            if r["event"] == "forward" and r["runner"] == runners[True]["runner"]
        }
        assert f"{case.draft_code}AttnBackend" in code, code
    calls = resolver_calls(records)
    assert [(c["algo_label"], c["answer"]) for c in calls] == [("DFLASH", case.drafts_on)], calls


def test_dflash_fallback_rule_decided_by_the_plugin_with_sglangs_warning(dflash: DFlashRuns) -> None:
    """Point 4 in an engine: no draft named and a target that cannot draft; acme's fallback drafts, SGLang says so
    in its own words, and SGLang's draft-worker resolver then keeps the settled name."""
    (call,) = resolver_calls(read_probe(dflash.runs.probes["fallback"]))
    assert (call["target"], call["named"], call["answer"]) == ("acme_target", TORCH_NATIVE, TORCH_NATIVE), call
    stderr = "".join(done.stderr for done in dflash.runs.drivers)
    assert SGLANG_FALLBACK_WARNING in stderr
    (named,) = resolver_calls(read_probe(dflash.runs.probes["batched"]))
    assert (named["named"], named["answer"]) == (BATCHED, BATCHED), named


def test_each_variant_changes_what_the_draft_proposes(dflash: DFlashRuns) -> None:
    """The proposal check can tell the variants apart: reading a draft without its variant proposes otherwise."""
    llama = dflash.models["llama"]
    readings = {  # the same weights, read without the variant (causal and noncausal drafts share their weights)
        "sliding": [dm.DraftKind("no window", ("sliding_attention", "full_attention"))],
        "noncausal": [dm.DRAFT_KINDS["causal"]],
        "causal": [dm.DRAFT_KINDS["noncausal"]],
    }
    for kind, others in readings.items():
        draft = dflash.drafts[kind]
        rows = dm.reference_verify_rows(llama.path, draft, dm.DRAFT_KINDS[kind], llama.prompts, llama.hf_ids)
        for other in others:
            assert dm.reference_verify_rows(llama.path, draft, other, llama.prompts, llama.hf_ids) != rows, kind


def test_dflash_drivers_left_nothing_behind(dflash: DFlashRuns) -> None:
    for done in dflash.runs.drivers:
        assert done.leftover == "none"


# -- point 4 without an engine: SGLang's own argument resolution and draft-worker resolver ---------------------------

RESOLVE = """
import json, os, sys
from attnhost_sglang_cpu import shim
shim.install()
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.runtime_context import publish
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.draft_worker_common import resolve_draft_worker_attention_backend
out = []
for argv, env in json.loads(sys.argv[1]):
    os.environ.update(env)
    try:
        args = prepare_server_args(argv)
        args.resolve_once()
        publish(args, role="scheduler")
        out.append({"settled": resolved_view(args).speculative_draft_attention_backend,
                    "worker": resolve_draft_worker_attention_backend(algo_label="DFLASH")})
    except Exception as exc:
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print("DFLASH-JSON " + json.dumps(out))
"""


def _resolve(argvs: list[tuple[list[str], dict[str, str]]], site: Path) -> tuple[list[dict[str, Any]], str]:
    """Each ``(argv, environment changes)`` resolved in turn, in one process with acme installed."""
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=sglang_env(path_entries=[str(site)]),
        timeout=400,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("DFLASH-JSON ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("DFLASH-JSON ")), done.stderr


def _dflash_argv(model: Path, draft: Path, target: str, draft_backend: str | None = None) -> list[str]:
    argv = [
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--skip-tokenizer-init",
        "--attention-backend",
        target,
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-num-draft-tokens",
        str(dm.BLOCK_SIZE),
    ]
    return argv + (["--speculative-draft-attention-backend", draft_backend] if draft_backend else [])


def test_dflash_draft_resolution_keeps_a_named_draft_and_lets_a_plugins_fallback_decide(
    model_dir: Path, tiny_model: TinyModel, tmp_path: Path
) -> None:
    draft = tmp_path / "draft"
    dm.build_dflash_draft(draft, tiny_model.path, dm.DRAFT_KINDS["noncausal"])
    site = _acme_site(tmp_path / "site")
    resolved, stderr = _resolve(
        [
            (_dflash_argv(model_dir, draft, "acme_target"), {}),  # cannot draft, none named: acme's fallback
            (_dflash_argv(model_dir, draft, "acme_target", BATCHED), {}),  # named: kept
            (_dflash_argv(model_dir, draft, TORCH_NATIVE), {}),  # the target drafts (acme lets it): kept
            # without a plugin's answer SGLang's own rule stands: the platform's default, with SGLang's warning
            (_dflash_argv(model_dir, draft, "acme_target"), {"ACME_DFLASH_FALLBACK": ""}),
        ],
        site,
    )
    assert resolved == [
        {"settled": TORCH_NATIVE, "worker": TORCH_NATIVE},
        {"settled": BATCHED, "worker": BATCHED},
        {"settled": TORCH_NATIVE, "worker": TORCH_NATIVE},
        {"settled": "triton", "worker": "triton"},
    ]
    assert stderr.count(SGLANG_FALLBACK_WARNING) == 1, stderr[-4000:]
    assert "(hook attnhost_draft_fallback)" in stderr
    assert (
        "DFLASH draft worker does not support attention_backend 'acme_target' on AttnhostTestCpuPlatform. "
        "Falling back to 'triton'." in stderr
    )
