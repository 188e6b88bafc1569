"""Speculative decoding in a real ``sglang.Engine`` on the CPU: greedy speculative ids equal the plain ids.

The oracle: with greedy sampling, speculative decoding must not change a single
token, so every case's ids must equal HF transformers' greedy ids, which
test_engine.py ties to the plain (non-speculative) engine's. Each case also
needs ``spec_verify_ct > 0`` (verification really ran) and the probe must show
each runner's backend class and the forward modes its backends ran: the
target ``EXTEND`` and ``TARGET_VERIFY``, the draft ``EXTEND``,
``DRAFT_EXTEND_V2`` and ``DECODE`` (the latter on the per-step children of the
draft worker's multi-step container).

The cases are one table keyed by attention backend names: the attnhost
cases, and one of SGLang's own ``triton`` backend (run by triton's
interpreter, ``SPECULATIVE_ENV``) as the reference that proves the scaffolding
itself (SGLang's speculative worker, the test platform's hooks and the kit's
tree-kernel stand-ins) independently of attnhost's adapter.

SGLang's EAGLE runs too, with a random EAGLE head made locally in the layout
SGLang's ``LlamaForCausalLMEagle`` loads (the kit's ``build_eagle_head``).

All cases run in one driver process (one engine after another) to keep the
CI budget: a speculative engine run takes about a minute here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from attnhost_sglang_cpu import SPECULATIVE_ENV
from attnhost_sglang_cpu import tiny_model as tm
from attnhost_sglang_cpu.e2e import (
    ADAPTER,
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

#: A third-party plugin for the fallback and refusal cases: ``acme_nodraft`` cannot draft, ``acme_draft`` can
#: and is this plugin's draft fallback on the CPU; neither declares tree masks. It also lets drafts use the
#: built-in ``torch_native`` (any plugin may name any backend draft-capable), so that one drafts on itself.
ACME = '''
"""acme-spec: a target-only backend, a draft backend that is the CPU draft fallback (test plugin)."""
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(name="acme_nodraft", factory="acme_spec.kernels:NoDraft", platforms=("cpu",), requires=("torch",),
                    description="acme, target only"),
        BackendSpec(name="acme_draft", factory="acme_spec.kernels:Drafter", platforms=("cpu",), requires=("torch",),
                    description="acme, draft-capable"),
    ]


@hookimpl
def attnhost_draft_attention_backends():
    return ["acme_draft", "torch_native"]


@hookimpl
def attnhost_draft_fallback(platform):
    return "acme_draft" if platform == "cpu" else None
'''

ACME_KERNELS = '''
"""acme's kernels: attnhost's torch_native math, declaring no tree masks."""
from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class NoDraft(TorchNativeAttnBackend):
    """acme attention, target only (test plugin)."""

    capabilities = BackendCapabilities(flat_heads=True, tree_mask=False)


class Drafter(NoDraft):
    """acme attention, draft-capable (test plugin)."""
'''


@dataclass(frozen=True)
class SpecCase:
    name: str
    target: str  # --attention-backend
    draft_backend: str | None = None  # --speculative-draft-attention-backend; None: SGLang's resolver decides
    topk: int = 1  # 1: a chain; 2: a tree
    draft: str = "random"  # "random": a random one-layer draft; "copy": the target's own weights; "eagle": EAGLE
    target_class: str = ADAPTER
    draft_class: str = ADAPTER
    refused: tuple[str, ...] = ()  # words the start-up error must contain (the run must fail)
    drafts_on: str | None = None  # the backend the draft runner must have resolved (default: the named or target's)

    def engine_run(self, drafts: dict[str, Path]) -> dict[str, Any]:
        algorithm = "EAGLE" if self.draft == "eagle" else "STANDALONE"
        args = speculative_args(
            str(drafts[self.draft]), algorithm=algorithm, topk=self.topk, draft_backend=self.draft_backend
        )
        return {"name": self.name, "backend": self.target, "engine_args": args}


CASES = [
    # SGLang's own backend through the kit: the reference, independent of attnhost's adapter.
    SpecCase("triton-tree", "triton", topk=2, target_class=SGLANG_TRITON, draft_class=SGLANG_TRITON),
    # attnhost backends as target and draft.
    SpecCase("chain-batched_matmul", "batched_matmul"),
    SpecCase("chain-attnhost_torch_native", "attnhost_torch_native"),
    SpecCase("chain-attnhost_torch_native-draft-tiny", "attnhost_torch_native", draft_backend="tiny"),
    # acme_nodraft cannot draft: acme's CPU fallback drafts
    SpecCase("chain-fallback-acme", "acme_nodraft", drafts_on="acme_draft"),
    SpecCase("tree-tiny", "tiny", topk=2),
    SpecCase("tree-attnhost_torch_native", "attnhost_torch_native", topk=2),
    # the compiled example writes the new K/V itself, through the speculative batches' strided out_cache_loc
    SpecCase("tree-cpu_paged", "cpu_paged", topk=2),
    SpecCase("copy-chain-batched_matmul", "batched_matmul", draft="copy"),
    SpecCase("eagle-tree-tiny", "tiny", topk=2, draft="eagle"),
    SpecCase("tree-refused-acme", "acme_draft", topk=2, refused=("acme_draft", "tree_mask")),
]


@pytest.fixture(scope="module")
def spec_runs(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> EngineRuns:
    """Every case's speculative engine, one after another in one driver process: one of the slow set-ups, eleven
    engine configurations (algorithm, tree shape, target and draft backends, draft model) no other test starts."""
    drafts = {kind: tmp_path_factory.mktemp(f"draft-{kind}") for kind in ("random", "copy", "eagle")}
    tm.build_draft_model(drafts["random"], tiny_model.path)
    tm.build_draft_model(drafts["copy"], tiny_model.path, copy_of_target=True)
    tm.build_eagle_head(drafts["eagle"], tiny_model.path)
    site = tmp_path_factory.mktemp("acme-spec-site")
    make_dist(
        site,
        "acme-spec",
        "1.0",
        {"sglang.draft_attention_backends": {"acme_spec": "acme_spec"}},
        modules={"acme_spec": ACME, "acme_spec.kernels": ACME_KERNELS},
    )
    return run_engines(
        tiny_model.path,
        tiny_model.prompts,
        NEW_TOKENS,
        [case.engine_run(drafts) for case in CASES],
        tmp_path_factory.mktemp("spec-probes"),
        env=SPECULATIVE_ENV,
        path_entries=[str(site)],
        timeout=1500,
    )


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_speculative_ids_equal_the_plain_ids(case: SpecCase, spec_runs: EngineRuns, tiny_model: TinyModel) -> None:
    result = spec_runs.results[case.name]
    if case.refused:
        error = result.get("error", "")
        assert error, f"a {case.target!r} tree run started; it must be refused at start-up"
        last = error.strip().splitlines()[-1]
        assert all(word in last for word in case.refused), last
        return
    assert "error" not in result, f"sglang.Engine, speculative {case.name}, failed:\n{result['error']}"
    assert result["output_ids"] == tiny_model.hf_ids
    verify = [meta.get("spec_verify_ct", 0) for meta in result["meta_info"]]
    assert all(ct > 0 for ct in verify), result["meta_info"]
    if case.draft == "copy":  # the target's own weights propose exactly its greedy tokens
        assert all(meta["spec_accept_length"] > 1.5 for meta in result["meta_info"]), result["meta_info"]

    seen = speculative_summary(read_probe(spec_runs.probes[case.name]))
    assert seen["target_class"] == [case.target_class], seen
    assert seen["draft_class"] == [case.draft_class], seen
    # the backends SGLang's DraftBackendFactory built for the draft worker carry the name they were built for
    assert seen["draft_backend"] == [case.drafts_on or case.draft_backend or case.target], seen
    assert {"EXTEND", "TARGET_VERIFY"} <= seen["modes"]["target"], seen
    assert {"EXTEND", "DRAFT_EXTEND_V2", "DECODE"} <= seen["modes"]["draft"], seen
    assert len(seen["children"]) == 3 - 1, seen  # one backend per draft step after the first (3 steps)
    assert seen["children_modes"] == {"DECODE"}, seen
    assert result["children_left"] == [], f"Engine.shutdown() left processes behind: {result['children_left']}"


def test_speculative_drivers_left_nothing_behind(spec_runs: EngineRuns) -> None:
    for done in spec_runs.drivers:
        assert done.leftover == "none"
