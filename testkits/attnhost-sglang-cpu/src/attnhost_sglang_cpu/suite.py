"""The suite ``pytest --attnhost-backend NAME --attnhost-engine sglang`` collects: NAME inside the real SGLang.

attnhost's pytest plugin finds this module through the entry point
``attnhost.engine_suites`` / ``sglang`` of this (test-only) distribution and
parametrizes :class:`TestSGLangEngine` with the backend names given. Not named
``test_*.py``: it is collected only through the option. Against each backend:

* the bridge: registered under its SGLang name (attnhost's own under a
  clash-free name), built by attnhost's adapter, in SGLang's draft choices
  exactly when draft-capable, and SGLang's own implementation of a clashing
  name kept;
* SGLang's own dense attention kit, every case, in each dtype and page size
  the backend declares (the others skip with the reason), each case also held to
  attnhost's float64 reference at the conformance kit's tolerance for the
  dtype (:mod:`attnhost_sglang_cpu.reference_check`: SGLang's ``3e-2`` lets a
  1 % error through), and its speculative verify kit
  for every verify input SGLang has (EAGLE, frozen-KV MTP, DFLASH, NGRAM;
  chains, and trees where the backend declares tree masks), with DFLASH's host
  lengths as a planning bound;
* SGLang's own MLA attention kit, every case, with and without a rotary part,
  in each declared dtype, for a backend that declares ``mla`` (the others
  skip with the reason);
* a real ``sglang.Engine`` on a tiny locally made Llama, ``NAME`` as the
  attention backend, whose greedy ids must equal HF transformers'; and the
  same with ``--page-size 16`` on prompts whose pages end part filled (a
  first and a prefix-cached pass), for a backend that declares page 16
  (``BackendCapabilities.page_sizes``; the others skip, naming it);
* a speculative chain (STANDALONE) with ``NAME`` as target and draft, also
  in pages of 16 (as above), and a tree when the backend declares tree masks:
  greedy ids equal HF's, with ``spec_verify_ct > 0``; the tree in pages of 16
  too, which SGLang 0.5.23 itself refuses for every backend but its
  flashinfer, fa3 and triton (the case then skips, quoting SGLang's error, so
  it runs the day SGLang lifts the rule);
* DFLASH with ``NAME`` as target and draft and SGLang's default DFlash draft
  (a tiny random one, :mod:`.dflash_model`), whose block attention is
  non-causal, for a draft-capable backend that declares ``non_causal`` (the
  others skip with the reason): HF's greedy ids, ``spec_verify_ct > 0``, the
  draft's runner built on ``NAME``, and every verify block equal to what a
  float64 reading of the draft proposes, because a greedy target's ids never
  depend on the draft, so only the proposals show a draft attended wrongly;
* the same engine with tensor parallelism (``tp_size=2``, two CPU ranks): HF's
  greedy ids, the adapter on every rank, and the ranks' agreement check passed;
  and with ``--page-size 16`` as above (both passes, each rank's adapter
  handed pages of 16), for a backend that declares page 16;
* the attention variants (:mod:`.variant_models`): tiny Gemma 2 (soft-cap and
  window), Gemma 3 (window) and gpt-oss (sinks and window, SGLang's hybrid
  window pool) engines, prompts longer than the window, HF's greedy ids on a
  first and a prefix-cached pass, for a backend that declares what the model
  needs (the others skip, naming the flags); and each again with
  ``--page-size 16`` (gpt-oss's window layers then in pages of the hybrid
  pool), for a backend that also declares page 16.

SGLang runs in this process for the first two (plugins loaded by SGLang's own
``load_plugins()``) and in spawned engine processes on the kit's CPU platform
for the rest, every engine case's engine in turn in one driver process for the
session (:class:`~attnhost_sglang_cpu.e2e.EngineDriver`, started again after a
crash). A failure is its message alone (``pytest.fail(...,
pytrace=False)``), naming the backend, the case and the size of the error or
the first differing position: the kit's and SGLang's frames would bury it, a
backend failing every case in screens of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from attnhost_sglang_cpu import SPECULATIVE_ENV, sglang_env, shim

shim.install()

import sglang  # noqa: E402
import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.arg_groups import choices  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402

from attnhost_sglang_cpu import dflash_model as dm  # noqa: E402
from attnhost_sglang_cpu import tiny_model as tm  # noqa: E402
from attnhost_sglang_cpu import variant_models as vm  # noqa: E402
from attnhost_sglang_cpu.dense import DTYPES, dense_cases, run_case  # noqa: E402
from attnhost_sglang_cpu.dflash_plugin import resolver_calls, verify_rows  # noqa: E402
from attnhost_sglang_cpu.e2e import (  # noqa: E402
    ADAPTER,
    SGLANG_SWA_POOL,
    EngineDriver,
    TinyModel,
    engine_failure,
    ids_mismatch,
    read_probe,
    speculative_summary,
)
from attnhost_sglang_cpu.mla_kit import ROPE_DIMS, mla_cases, run_mla_case  # noqa: E402
from attnhost_sglang_cpu.reference_check import reference_problem  # noqa: E402
from attnhost_sglang_cpu.run_engine import speculative_args  # noqa: E402
from attnhost_sglang_cpu.spec_verify import (  # noqa: E402
    SPEC_VERIFY_KINDS,
    run_spec_verify_case,
    spec_verify_case,
    spec_verify_id,
)

__all__ = ["TestSGLangEngine"]

NEW_TOKENS = 8
BRIDGE = "attnhost.engines.sglang.bridge"
#: SGLang wants one CPU set per rank when the ranks outnumber NUMA nodes.
RANK_CPUS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
N_DENSE = len(dense_cases("any"))
N_MLA = len(mla_cases("any"))
#: The page size of the paged engine runs (SGLang's --page-size), and prompt lengths whose last page it part fills.
PAGE = 16
PAGED_LENGTHS = (27, 45)
#: The kit's variant models SGLang serves from its hybrid window pool (``SWAKVPool``: the window layers' keys in a
#: pool of their own), which the adapter reads through a translated slot table.
HYBRID_POOL_MODELS = ("gpt_oss",)
#: SGLang's own refusals of a configuration (its server-argument checks), which skip a case quoting SGLang: a
#: speculative tree (topk > 1) in pages (page_size > 1) only on its flashinfer, fa3 and triton backends, since
#: SGLang's paged tree draft decode is theirs.
SGLANG_RULES = ("speculative_eagle_topk > 1 with page_size > 1 is only supported on",)


def _entry(name: str) -> Any:
    from attnhost.host import get_registry

    registry = get_registry()
    if name not in registry:
        pytest.fail(f"attnhost backend {name!r}: {registry.unknown_message(name)}", pytrace=False)
    return registry.entry(name)


def sglang_name(name: str) -> str:
    """The name SGLang knows attnhost backend *name* by (attnhost's bridge renames a clash with SGLang's own)."""
    from attnhost.engines.sglang.bridge import current_plan

    plan = current_plan()
    exported = plan.engine_name(name) if plan is not None else None
    if exported is None:
        why = "; ".join(plan.skipped) if plan is not None else "attnhost's SGLang plugin did not run"
        pytest.fail(f"backend {name!r} is not exported to SGLang ({why})", pytrace=False)
    return exported


def _capabilities(name: str) -> Any:
    from attnhost.backend import capabilities_of

    return capabilities_of(_entry(name).spec.load())


@pytest.fixture(scope="session")
def kit_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    path = tmp_path_factory.mktemp("attnhost-kit-llama")
    tm.build_model(path)
    prompts = tm.prompt_ids(path)
    return TinyModel(path, prompts, tm.hf_greedy(path, prompts, NEW_TOKENS))


@pytest.fixture(scope="session")
def kit_draft(tmp_path_factory: pytest.TempPathFactory, kit_model: TinyModel) -> Path:
    path = tmp_path_factory.mktemp("attnhost-kit-draft")
    tm.build_draft_model(path, kit_model.path)
    return path


@pytest.fixture(scope="session")
def kit_dflash_draft(tmp_path_factory: pytest.TempPathFactory, kit_model: TinyModel) -> Path:
    """SGLang's default DFlash draft for the kit's Llama: one non-causal block-attention layer."""
    path = tmp_path_factory.mktemp("attnhost-kit-dflash-draft")
    dm.build_dflash_draft(path, kit_model.path, dm.DRAFT_KINDS["noncausal"])
    return path


@pytest.fixture(scope="session")
def kit_paged_model(kit_model: TinyModel) -> TinyModel:
    """The kit's Llama with prompts of several pages (its own, repeated) and HF's greedy ids for them."""
    prompts = [(kit_model.prompts[i % len(kit_model.prompts)] * 64)[:n] for i, n in enumerate(PAGED_LENGTHS)]
    return TinyModel(kit_model.path, prompts, tm.hf_greedy(kit_model.path, prompts, NEW_TOKENS))


@pytest.fixture(scope="session")
def kit_variant_models(tmp_path_factory: pytest.TempPathFactory, kit_model: TinyModel) -> Callable[[str], TinyModel]:
    """The variant model of a kind with HF's greedy ids, built when a case first asks for it and shared by every
    case and backend after (each build checks in HF that each of the model's features changes the ids)."""
    built: dict[str, TinyModel] = {}

    def model(kind: str) -> TinyModel:
        if kind not in built:
            out = tmp_path_factory.mktemp(f"attnhost-kit-{kind}")
            built[kind] = vm.prepare_variant_model(kind, out, NEW_TOKENS, tokenizer_from=kit_model.path)
        return built[kind]

    return model


@pytest.fixture(scope="session")
def kit_engine_driver() -> Iterator[EngineDriver]:
    """One engine driver for every engine case of the session, each backend's, one engine after another as a
    user's script would run them: a driver's start imports SGLang, about as long as a tiny engine's run here. A run
    that ends the driver (a crashed engine) gets a new one for the next case."""
    with EngineDriver(sglang_env()) as driver:
        yield driver


def _skip_unless_page(name: str, page: int) -> None:
    """Skip, naming the backend and the size, a case in pages the backend does not declare (the adapter would
    refuse it when the runner builds it)."""
    declared = _capabilities(name).page_sizes
    if declared is not None and page not in declared:
        pytest.skip(
            f"backend {name!r} does not declare KV-cache page size {page} (BackendCapabilities.page_sizes = "
            f"{declared}; SGLang's --page-size {page})"
        )


def _short(check: Callable[[], None]) -> None:
    """Run one of the kit's numeric checks; its failure (a message naming backend, case and error) is shown alone."""
    message = _kit_failure(check)
    if message is not None:
        pytest.fail(message, pytrace=False)


def _kit_failure(check: Callable[[], None]) -> str | None:
    """The message of the kit's own failure of *check* (one that leads with ``backend``), or ``None`` if it
    passed; any other error propagates, its traceback the only clue. Failing outside the ``except`` keeps
    pytest from printing the caught error as well."""
    try:
        check()
    except AssertionError as error:
        if not str(error).startswith("backend "):
            raise
        return str(error)
    return None


def _engine(
    driver: EngineDriver,
    model: TinyModel,
    backend: str,
    case: str,
    tmp: Path,
    env: dict[str, str] | None = None,
    passes: int = 1,
    **engine_args: Any,
) -> tuple[dict[str, Any], Path]:
    extra = env if env is not None else (SPECULATIVE_ENV if engine_args else {})
    run = {"backend": backend, "passes": passes, "engine_args": engine_args, "env": extra}
    results, probes = driver.run(model.path, model.prompts, NEW_TOKENS, [run], tmp)
    result = results[backend]
    if "error" in result:
        refusal = _sglang_refusal(result["error"])
        if refusal is not None:
            pytest.skip(
                f"SGLang {sglang.__version__} refuses the {case} in its own server-argument check, whatever the "
                f"backend: {refusal}"
            )
        pytest.fail(engine_failure(backend, case, result["error"]), pytrace=False)
    return result, probes[backend]


def _sglang_refusal(error: str) -> str | None:
    """SGLang's own error line when an engine run failed on one of :data:`SGLANG_RULES`, else ``None``."""
    for line in reversed(error.splitlines()):
        if line.startswith("ValueError: ") and any(rule in line for rule in SGLANG_RULES):
            return line.removeprefix("ValueError: ")
    return None


def _paged_engine(
    driver: EngineDriver,
    model: TinyModel,
    backend: str,
    case: str,
    tmp: Path,
    env: dict[str, str] | None = None,
    **engine_args: Any,
) -> list[dict[str, Any]]:
    """An engine run in pages of :data:`PAGE` on prompts whose last page is part filled, a first and a
    prefix-cached pass: HF's greedy ids in both, and every runner's adapter handed a cache in pages of
    :data:`PAGE`. Returns the runner records of the probe, for the case's own checks."""
    result, probe = _engine(driver, model, backend, case, tmp, env, passes=2, page_size=PAGE, **engine_args)
    _same_ids(backend, case, result, model)
    _same_ids(backend, f"{case}, prefix-cached pass", result["later_passes"][0], model)
    runners = [r for r in read_probe(probe) if r["event"] == "runner"]
    seen = [r["attnhost_kv_format"] for r in runners]
    if not seen or not all(f is not None and f["page_size"] == PAGE for f in seen):
        pytest.fail(
            f"backend {backend!r}, {case}: attnhost's backend saw caches {seen}, not pages of {PAGE}", pytrace=False
        )
    return runners


def _same_ids(backend: str, case: str, result: dict[str, Any], model: TinyModel) -> None:
    problem = ids_mismatch(backend, case, result["output_ids"], model.hf_ids)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def _speculated(
    backend: str, case: str, result: dict[str, Any], model: TinyModel, probe: Path, modes: dict[str, set[str]]
) -> list[dict[str, Any]]:
    """A speculative run's shared oracles: HF's greedy ids, every prompt verified, and each role's model runner
    running the forward *modes* named for it. Returns the probe's records for the case's own checks."""
    _same_ids(backend, case, result, model)
    unverified = [i for i, meta in enumerate(result["meta_info"]) if not meta.get("spec_verify_ct", 0) > 0]
    if unverified:
        pytest.fail(
            f"backend {backend!r}, {case}: prompt(s) {unverified} were never verified (spec_verify_ct 0): the "
            "engine did not decode speculatively",
            pytrace=False,
        )
    records = read_probe(probe)
    seen = speculative_summary(records)
    for role, needed in modes.items():
        if not needed <= seen["modes"][role]:
            pytest.fail(
                f"backend {backend!r}, {case}: the {role} model runner's backends ran "
                f"{sorted(seen['modes'][role])}, not {sorted(needed)}",
                pytrace=False,
            )
    return records


class TestSGLangEngine:
    """One attnhost backend inside the real SGLang (the plugin parametrizes ``attnhost_backend_name``)."""

    attnhost_cli_suite: ClassVar[bool] = True

    def test_registered_with_sglang(self, attnhost_backend_name: str) -> None:
        name = attnhost_backend_name
        exported = sglang_name(name)
        factory = ATTENTION_BACKENDS.get(exported)
        assert factory is not None and factory.__module__ == BRIDGE, (
            f"SGLang's ATTENTION_BACKENDS[{exported!r}] is {factory!r}, not attnhost's adapter factory"
        )
        assert exported in choices.ATTENTION_BACKEND_CHOICES
        draft = _entry(name).draft
        assert (exported in choices.DRAFT_ATTENTION_BACKEND_CHOICES) == draft, (
            f"{exported!r} {'missing from' if draft else 'wrongly in'} SGLang's draft choices (draft-capable: {draft})"
        )
        canonical = _entry(name).name
        if exported != canonical:  # a clash with one of SGLang's own names: SGLang keeps its own
            assert not ATTENTION_BACKENDS[canonical].__module__.startswith("attnhost."), (
                f"attnhost took over SGLang's own {canonical!r}"
            )

    @pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
    @pytest.mark.parametrize("case_index", range(N_DENSE))
    def test_sglang_dense_kit(self, attnhost_backend_name: str, dtype: torch.dtype, case_index: int) -> None:
        _skip_unless_dtype(attnhost_backend_name, dtype)
        case = dense_cases(sglang_name(attnhost_backend_name))[case_index]
        _skip_unless_page(attnhost_backend_name, case.page_size)
        sglang_failure = _kit_failure(lambda: run_case(case, dtype))  # SGLang's own check first: users know it
        problem = reference_problem(case, dtype, attnhost_backend_name)
        if sglang_failure is not None:  # with the mistake the output matches, when one does
            pytest.fail(f"{sglang_failure}{'; ' + problem.why if problem and problem.why else ''}", pytrace=False)
        if problem is not None:
            pytest.fail(problem.message, pytrace=False)

    @pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
    @pytest.mark.parametrize("kind", SPEC_VERIFY_KINDS, ids=[spec_verify_id(*kind) for kind in SPEC_VERIFY_KINDS])
    def test_sglang_spec_verify_kit(
        self, attnhost_backend_name: str, kind: tuple[str, int, bool], dtype: torch.dtype
    ) -> None:
        spec_kind, topk, host_bound = kind
        _skip_unless_dtype(attnhost_backend_name, dtype)
        if topk > 1:
            _skip_unless_trees(attnhost_backend_name)
        case = spec_verify_case(sglang_name(attnhost_backend_name), (3, 30, 12), (4, 2), topk)
        _short(lambda: run_spec_verify_case(case, spec_kind=spec_kind, topk=topk, dtype=dtype, host_bound=host_bound))

    @pytest.mark.parametrize("rope", ROPE_DIMS, ids=[f"rope{r}" for r in ROPE_DIMS])
    @pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
    @pytest.mark.parametrize("case_index", range(N_MLA))
    def test_sglang_mla_kit(self, attnhost_backend_name: str, dtype: torch.dtype, case_index: int, rope: int) -> None:
        if not _capabilities(attnhost_backend_name).mla:
            pytest.skip(f"backend {attnhost_backend_name!r} does not declare MLA (capabilities.mla)")
        _skip_unless_dtype(attnhost_backend_name, dtype)
        _short(lambda: run_mla_case(mla_cases(sglang_name(attnhost_backend_name))[case_index], dtype, rope))

    def test_engine_greedy_ids_equal_hf(
        self, attnhost_backend_name: str, kit_model: TinyModel, kit_engine_driver: EngineDriver, tmp_path: Path
    ) -> None:
        backend = sglang_name(attnhost_backend_name)
        result, probe = _engine(kit_engine_driver, kit_model, backend, "engine greedy ids", tmp_path)
        _same_ids(backend, "engine greedy ids", result, kit_model)
        built = {r["backend_class"] for r in read_probe(probe) if r["event"] == "runner"}
        assert built == {ADAPTER}, f"the model runner built {built}, not attnhost's adapter"

    def test_engine_paged_greedy_ids_equal_hf(
        self, attnhost_backend_name: str, kit_paged_model: TinyModel, kit_engine_driver: EngineDriver, tmp_path: Path
    ) -> None:
        _skip_unless_page(attnhost_backend_name, PAGE)
        backend = sglang_name(attnhost_backend_name)
        _paged_engine(
            kit_engine_driver, kit_paged_model, backend, f"engine greedy ids (--page-size {PAGE})", tmp_path, env={}
        )

    def test_tensor_parallel_greedy_ids_equal_hf(
        self, attnhost_backend_name: str, kit_model: TinyModel, kit_engine_driver: EngineDriver, tmp_path: Path
    ) -> None:
        backend = sglang_name(attnhost_backend_name)
        case = "tensor-parallel greedy ids (tp_size=2)"
        result, probe = _engine(kit_engine_driver, kit_model, backend, case, tmp_path, env=RANK_CPUS, tp_size=2)
        _same_ids(backend, case, result, kit_model)
        ranks = {r["pid"] for r in read_probe(probe) if r["event"] == "runner" and r["backend_class"] == ADAPTER}
        assert len(ranks) == 2, f"attnhost's adapter ran in {len(ranks)} rank process(es), not 2"

    def test_tensor_parallel_paged_greedy_ids_equal_hf(
        self, attnhost_backend_name: str, kit_paged_model: TinyModel, kit_engine_driver: EngineDriver, tmp_path: Path
    ) -> None:
        _skip_unless_page(attnhost_backend_name, PAGE)
        backend = sglang_name(attnhost_backend_name)
        case = f"tensor-parallel greedy ids (tp_size=2, --page-size {PAGE})"
        runners = _paged_engine(kit_engine_driver, kit_paged_model, backend, case, tmp_path, env=RANK_CPUS, tp_size=2)
        ranks = {r["pid"] for r in runners if r["backend_class"] == ADAPTER}
        if len(ranks) != 2:
            pytest.fail(
                f"backend {backend!r}, {case}: attnhost's adapter ran in {len(ranks)} rank process(es), not 2",
                pytrace=False,
            )

    @pytest.mark.parametrize(
        ("topk", "page"), [(1, 1), (2, 1), (1, PAGE), (2, PAGE)], ids=["chain", "tree", "chain-page16", "tree-page16"]
    )
    def test_speculative_ids_equal_hf(
        self,
        attnhost_backend_name: str,
        topk: int,
        page: int,
        kit_model: TinyModel,
        kit_paged_model: TinyModel,
        kit_draft: Path,
        kit_engine_driver: EngineDriver,
        tmp_path: Path,
    ) -> None:
        if topk > 1:
            _skip_unless_trees(attnhost_backend_name)
        _skip_unless_draft(attnhost_backend_name)
        _skip_unless_page(attnhost_backend_name, page)
        backend = sglang_name(attnhost_backend_name)
        case = f"speculative {'chain' if topk == 1 else 'tree'} (STANDALONE, topk {topk})"
        args = speculative_args(str(kit_draft), topk=topk)
        if page > 1:
            case, args, kit_model = f"{case[:-1]}, --page-size {page})", {**args, "page_size": page}, kit_paged_model
        result, probe = _engine(kit_engine_driver, kit_model, backend, case, tmp_path, **args)
        modes = {"target": {"EXTEND", "TARGET_VERIFY"}, "draft": {"DRAFT_EXTEND_V2", "DECODE"}}
        _speculated(backend, case, result, kit_model, probe, modes)

    def test_engine_dflash_greedy_ids_equal_hf(
        self,
        attnhost_backend_name: str,
        kit_model: TinyModel,
        kit_dflash_draft: Path,
        kit_engine_driver: EngineDriver,
        tmp_path: Path,
    ) -> None:
        if not getattr(_capabilities(attnhost_backend_name), "non_causal", False):
            pytest.skip(
                f"backend {attnhost_backend_name!r} does not declare non_causal (BackendCapabilities), which the "
                "default DFlash draft's block attention needs"
            )
        _skip_unless_draft(attnhost_backend_name)
        backend = sglang_name(attnhost_backend_name)
        case = "DFLASH (non-causal DFlash draft, target and draft on the backend)"
        args = speculative_args(
            str(kit_dflash_draft),
            algorithm="DFLASH",
            num_steps=1,
            num_draft_tokens=dm.BLOCK_SIZE,
            draft_backend=backend,
        )
        result, probe = _engine(kit_engine_driver, kit_model, backend, case, tmp_path, **args)
        # a DFlash draft runs its block only (TARGET_VERIFY): its context K/V are written without attention
        records = _speculated(
            backend, case, result, kit_model, probe, {"target": {"EXTEND", "TARGET_VERIFY"}, "draft": {"TARGET_VERIFY"}}
        )
        drafts = [r for r in records if r["event"] == "runner" and r["is_draft_worker"]]
        on = [
            (r["backend_class"], r["prefill_attention_backend_str"], r["decode_attention_backend_str"]) for r in drafts
        ]
        resolved = [c["answer"] for c in resolver_calls(records)]
        if on != [(ADAPTER, backend, backend)] or resolved != [backend]:
            pytest.fail(
                f"backend {backend!r}, {case}: the draft did not run on it (draft runners' backend class and "
                f"names {on}, SGLang's draft-backend resolver answered {resolved})",
                pytrace=False,
            )
        ran = Counter((n, tuple(ids)) for n, ids in verify_rows(records))
        rows = dm.reference_verify_rows(
            kit_model.path, kit_dflash_draft, dm.DRAFT_KINDS["noncausal"], kit_model.prompts, kit_model.hf_ids
        )
        expected = Counter((n, tuple(ids)) for prompt in rows for n, ids in prompt)
        if ran != expected:  # a batch interleaves its requests' rows: compared as multisets
            pytest.fail(
                f"backend {backend!r}, {case}: the draft proposed otherwise than its definition (float64): verify "
                f"blocks (committed length, [bonus, proposals]) {sorted((ran - expected).elements())} ran where "
                f"{sorted((expected - ran).elements())} were due: does the draft's block attend non-causally "
                "(is_causal=False)?",
                pytrace=False,
            )

    @pytest.mark.parametrize("kind", vm.VARIANT_MODELS)
    def test_engine_variant_model_greedy_ids_equal_hf(
        self,
        attnhost_backend_name: str,
        kind: str,
        kit_variant_models: Callable[[str], TinyModel],
        kit_engine_driver: EngineDriver,
        tmp_path: Path,
    ) -> None:
        _skip_unless_variants(attnhost_backend_name, kind)
        model = kit_variant_models(kind)
        backend = sglang_name(attnhost_backend_name)
        run = {"backend": backend, "passes": 2, "env": SPECULATIVE_ENV}
        results, _ = kit_engine_driver.run(model.path, model.prompts, NEW_TOKENS, [run], tmp_path)
        result = results[backend]
        assert "error" not in result, f"sglang.Engine, tiny {kind} on {backend!r}, failed:\n{result['error']}"
        passes = [result["output_ids"], *(later["output_ids"] for later in result["later_passes"])]
        assert passes == [model.hf_ids, model.hf_ids], (
            f"tiny {kind} on {backend!r}: greedy ids (first pass, prefix-cached pass) {passes} differ from HF "
            f"transformers' {model.hf_ids}"
        )

    @pytest.mark.parametrize("kind", vm.VARIANT_MODELS)
    def test_engine_variant_model_paged_greedy_ids_equal_hf(
        self,
        attnhost_backend_name: str,
        kind: str,
        kit_variant_models: Callable[[str], TinyModel],
        kit_engine_driver: EngineDriver,
        tmp_path: Path,
    ) -> None:
        _skip_unless_variants(attnhost_backend_name, kind)
        _skip_unless_page(attnhost_backend_name, PAGE)
        model = kit_variant_models(kind)
        backend = sglang_name(attnhost_backend_name)
        case = f"tiny {kind} greedy ids (--page-size {PAGE})"
        runners = _paged_engine(kit_engine_driver, model, backend, case, tmp_path, env=SPECULATIVE_ENV)
        pools = sorted({r["kv_pool_class"] for r in runners if not r["is_draft_worker"]})
        if (pools == [SGLANG_SWA_POOL]) != (kind in HYBRID_POOL_MODELS):
            pytest.fail(
                f"backend {backend!r}, {case}: SGLang built the pool(s) {pools}; the kit expects its hybrid window "
                f"pool exactly for {', '.join(HYBRID_POOL_MODELS)}",
                pytrace=False,
            )


# Each family of cases a backend may not declare skips from one place with one sentence per backend, so that
# pytest's skip summary (-rs) shows a family as one line, not one line per case.


def _skip_unless_dtype(name: str, dtype: torch.dtype) -> None:
    """Skip a case in a model dtype the backend does not declare (the engine refuses such a model)."""
    declared = _capabilities(name).dtypes
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in declared:
        pytest.skip(f"backend {name!r} does not declare {dtype_name} (dtypes = {declared})")


def _skip_unless_trees(name: str) -> None:
    """Skip a speculative tree case for a backend without tree masks (SGLang refuses a tree run for it)."""
    if not _capabilities(name).tree_mask:
        pytest.skip(f"backend {name!r} does not declare tree masks (capabilities.tree_mask)")


def _skip_unless_draft(name: str) -> None:
    """Skip a speculative engine case for a target-only backend (SGLang refuses it as a draft)."""
    if not _entry(name).draft:
        pytest.skip(f"backend {name!r} is not draft-capable")


def _skip_unless_variants(name: str, kind: str) -> None:
    """Skip a variant model whose attention the backend does not declare, in one sentence naming every flag the
    variant models need that the backend lacks and which model needs which (the same for each model skipped)."""
    capabilities = _capabilities(name)
    missing = {k: [f for f in vm.FEATURES[k] if not getattr(capabilities, f, False)] for k in vm.VARIANT_MODELS}
    if missing[kind]:
        flags = ", ".join(dict.fromkeys(flag for needed in missing.values() for flag in needed))
        needs = "; ".join(f"tiny {k}: {', '.join(vm.FEATURES[k])}" for k in vm.VARIANT_MODELS if missing[k])
        pytest.skip(
            f"backend {name!r} does not declare {flags} (BackendCapabilities), which the variant models skipped "
            f"here need ({needs})"
        )
