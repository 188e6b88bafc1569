"""The conformance kit (``attnhost.testing``): it passes correct backends and catches subtly wrong ones.

The wrong backends are real installed distributions (written by ``distgen``)
and the kit runs against them the way a plugin author runs it: ``pytest`` in
a fresh interpreter, on a test file that only subclasses ``BackendConformance``,
or with ``pytest --attnhost-backend NAME`` and no test file at all. The
outcome is read from JUnit XML, so each assertion is about *which* test
failed and *what its message says*.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the conformance kit runs backends; the py312/py313 envs have no torch
pytestmark = pytest.mark.torch
from distgen import make_dist
from helpers import GROUP, run_python, subprocess_env

from attnhost.testing import BackendConformance


class TestTorchNativeConformance(BackendConformance):
    """The kit in-process against the built-in backend (target-only, so the draft test is skipped)."""

    backend_name = "torch_native"
    expect_draft = False


def test_a_non_finite_reference_never_passes_as_agreement(request: pytest.FixtureRequest) -> None:
    """A NaN in the reference makes every difference NaN, and NaN > tolerance is False: the kit must not read
    that as agreement (a query that sees no key once gave the reference 0/0)."""
    import torch

    from attnhost.forward_mode import ForwardMode
    from attnhost.host import get_registry

    kit = TestTorchNativeConformance()
    kit.name, kit.entry = "torch_native", get_registry().entry("torch_native")
    kit._generator, kit._pytest_config = torch.Generator().manual_seed(0), request.config
    runner = kit._runner()
    step = kit._forward(runner, ForwardMode.EXTEND, [(runner.new_request(), 0, 5)], "prefill", check=False)
    run = step.layers[0]
    assert kit._output_error(run, step.batch) is None
    poisoned = run.expected_v.clone()
    poisoned[step.batch.out_cache_loc[2]] = float("nan")
    problem = kit._output_error(run, step.batch, v_buffer=poisoned)
    assert problem is not None and problem.startswith("max abs error nan exceeds 1e-05"), problem


# -- subtly wrong backends, as installed distributions ------------------------------

_PLUGIN = '''\
"""Hooks only: discovery must stay cheap."""
from attnhost import BackendSpec, hookimpl

NAMES = (
    "correct", "off_by_a_thousandth", "wrong_slot", "no_prefix_offset", "leaky_global",
    "uses_arguments", "layer_zero", "float32_only", "bad_half", "bad_caps", "flat_heads", "flat_liar",
    "tree_liar", "nan_tree",
)
_CLASSES = (
    "Correct", "OffByAThousandth", "WrongSlot", "NoPrefixOffset", "LeakyGlobal",
    "UsesArguments", "LayerZero", "Float32Only", "BadHalf", "BadCaps", "FlatHeads", "FlatLiar",
    "TreeLiar", "NaNTree",
)


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(name=n, factory=f"attnhost_broken.impl:{c}", requires=("torch",), description=f"test backend {n}")
        for n, c in zip(NAMES, _CLASSES)
    ]


@hookimpl
def attnhost_draft_attention_backends():
    return list(NAMES)
'''

_IMPL = '''\
"""One loop-based backend with switches for the bugs the kit must catch."""
import torch

from attnhost import AttentionBackend, BackendCapabilities

_LAST_BUILT = None


class Correct(AttentionBackend):
    """A correct per-request backend."""

    scale = 1.0
    roll_slots = False
    prefix_offset = True
    attend_arguments = False  # with save_kv_cache=False, attend over the k/v arguments (the bug)
    write_layer = None  # a fixed layer to write every layer's K/V into (the bug)
    half_bug = False  # float16 output zeroed (a broken half-precision path)
    honour_tree = False  # attend as forward_batch.tree_mask says, with a plain softmax

    def init_forward_metadata(self, forward_batch):
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _attend(self, q, k, v, layer, fb, save_kv_cache):
        pool = fb.kv_pool
        if save_kv_cache:
            loc = fb.out_cache_loc.roll(1) if self.roll_slots else fb.out_cache_loc
            target = layer.layer_id if self.write_layer is None else self.write_layer
            pool.set_kv(target, loc, k, v)
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        cell = 0  # where request i's block starts in fb.tree_mask
        for i in range(fb.batch_size):
            start, new, prefix = fb.extend_start_loc_cpu[i], fb.extend_seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = pool.req_to_token[fb.req_pool_indices[i], : fb.seq_lens_cpu[i]]
            keys = pool.k_buffer(layer.layer_id)[slots].double()
            values = pool.v_buffer(layer.layer_id)[slots].double()
            if self.attend_arguments and not save_kv_cache:
                keys[prefix:] = k[start : start + new].double()
                values[prefix:] = v[start : start + new].double()
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q[start : start + new].double(), keys) * layer.scaling
            offset = prefix if self.prefix_offset else 0
            visible = torch.arange(len(slots)) <= offset + torch.arange(new)[:, None]
            if self.honour_tree and fb.tree_mask is not None:
                visible[:, prefix:] = fb.tree_mask[cell : cell + new * new].view(new, new)
                cell += new * new
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start : start + new] = (torch.einsum("hts,shd->thd", weights, values) * self.scale).to(q.dtype)
        if self.half_bug and q.dtype == torch.float16:
            out.zero_()
        return out


class OffByAThousandth(Correct):
    scale = 1.001


class WrongSlot(Correct):
    roll_slots = True


class NoPrefixOffset(Correct):
    prefix_offset = False


class LeakyGlobal(Correct):
    def __init__(self, runner=None):
        super().__init__(runner)
        global _LAST_BUILT
        _LAST_BUILT = self


class UsesArguments(Correct):
    attend_arguments = True


class LayerZero(Correct):
    write_layer = 0


class Float32Only(Correct):
    capabilities = BackendCapabilities(dtypes=("float32",))


class BadHalf(Correct):
    capabilities = BackendCapabilities(dtypes=("float32", "float16"))
    half_bug = True


class BadCaps(Correct):
    capabilities = {"dtypes": ("float32",)}


class FlatHeads(Correct):
    """Declares flat_heads and keeps to it: [T, heads * head_dim] in, the same out."""

    capabilities = BackendCapabilities(flat_heads=True)

    def _attend(self, q, k, v, layer, fb, save_kv_cache):
        out = super()._attend(q.view(len(q), layer.num_heads, layer.head_dim), k, v, layer, fb, save_kv_cache)
        return out.flatten(1) if q.dim() == 2 else out


class FlatLiar(Correct):
    """Declares flat_heads, then answers [T, heads, head_dim] anyway (the bug)."""

    capabilities = BackendCapabilities(flat_heads=True)

    def _attend(self, q, k, v, layer, fb, save_kv_cache):
        return super()._attend(q.view(len(q), layer.num_heads, layer.head_dim), k, v, layer, fb, save_kv_cache)


class TreeLiar(Correct):
    """Declares tree_mask, then attends causally anyway, ignoring forward_batch.tree_mask (the bug)."""

    capabilities = BackendCapabilities(tree_mask=True)


class NaNTree(Correct):
    """Honours tree_mask, with a softmax that gives a query seeing no key 0/0: NaN, not zeros (the bug)."""

    capabilities = BackendCapabilities(tree_mask=True)
    honour_tree = True


'''

# The shorthand's class has no docstring, so inspect would describe it with AttentionBackend's.
_NODOC = """\
from attnhost import AttentionBackend


class NoDocstring(AttentionBackend):
    scale, roll_slots, prefix_offset, attend_arguments, write_layer, half_bug = 1.0, False, True, False, None, False
    honour_tree = False

    def init_forward_metadata(self, forward_batch):
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        from attnhost_broken.impl import Correct

        return Correct._attend(self, q, k, v, layer, forward_batch, save_kv_cache)
"""

# A plugin whose hook name is misspelled: it fails to load, so its backend never registers.
_TYPO = """\
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backend():
    return [BackendSpec(name="typo", factory="attnhost_broken.impl:Correct", description="never registered")]
"""

_EAGER = '''\
"""A correct shorthand backend whose module imports torch at discovery time."""
import torch  # the mistake: `attnhost list` now pays for torch

from attnhost_broken.impl import Correct


class EagerBackend(Correct):
    """Correct numerics, eager import."""
'''

_KIT_FILE = """\
from attnhost.testing import BackendConformance


class Broken(BackendConformance):
    page_sizes_to_test = (16,)  # one paged cache is enough to see each mistake; TestCorrect runs all three
    production_shapes_to_test = ("gqa-32-4-d64",)  # likewise one production shape


class TestCorrect(BackendConformance):
    backend_name = "correct"
    expect_draft = True


class TestOffByAThousandth(Broken):
    backend_name = "off_by_a_thousandth"


class TestWrongSlot(Broken):
    backend_name = "wrong_slot"


class TestNoPrefixOffset(Broken):
    backend_name = "no_prefix_offset"


class TestLeakyGlobal(Broken):
    backend_name = "leaky_global"


class TestEager(Broken):
    backend_name = "eager"


class TestUsesArguments(Broken):
    backend_name = "uses_arguments"


class TestLayerZero(Broken):
    backend_name = "layer_zero"


class TestFloat32Only(Broken):
    backend_name = "float32_only"


class TestBadHalf(Broken):
    backend_name = "bad_half"


class TestBadCaps(Broken):
    backend_name = "bad_caps"


class TestFlatHeads(Broken):
    backend_name = "flat_heads"


class TestFlatLiar(Broken):
    backend_name = "flat_liar"


class TestTreeLiar(Broken):
    backend_name = "tree_liar"


class TestNaNTree(Broken):
    backend_name = "nan_tree"


class TestNoDocstring(Broken):
    backend_name = "nodoc"


class TestTypo(Broken):
    backend_name = "typo"
"""

# Every test of the kit, by the name pytest gives it (parametrized ones once per case).
KIT_TESTS = (
    "test_spec_name_and_description",
    "test_spec_roles",
    "test_spec_factory_importable_and_available",
    "test_discovery_imports_neither_torch_nor_the_implementation",
    "test_target_runner_builds_and_stamps_its_backend",
    "test_draft_runner_builds_and_stamps_its_backend",
    "test_extend_without_prefix",
    "test_extend_with_cached_prefix",
    "test_decode",
    "test_batch_of_requests_with_different_lengths",
    "test_target_verify_chain",
    "test_target_verify_tree",
    "test_a_query_that_sees_no_key_gets_zeros",
    "test_draft_extend",
    "test_draft_decode_over_branch_rows",
    "test_head_layouts_mha_gqa_mqa[mha-4-4]",
    "test_head_layouts_mha_gqa_mqa[gqa-8-2]",
    "test_head_layouts_mha_gqa_mqa[mqa-8-1]",
    "test_bfloat16",
    "test_flat_heads_layout",
    "test_declared_capabilities_are_valid_and_hold",
    "test_kv_lands_in_the_right_cache_slots",
    "test_save_kv_cache_false_neither_writes_nor_uses_k_v",
    "test_idle_batch_gives_an_empty_output",
    "test_runners_are_isolated",
    "test_nothing_global_changes",
    # MLA (attnhost.testing.mla_conformance): skipped unless the backend declares mla, but the refusal
    "test_mla_refused_unless_declared",
    "test_mla_extend",
    "test_mla_decode",
    "test_mla_mixed_and_target_verify",
    "test_mla_draft",
    "test_mla_flat_heads",
    "test_mla_mha_form",
    "test_mla_idle_batch",
    "test_mla_production_shape",
    # attention variants (attnhost.testing.variant_conformance): skipped unless the backend declares them
    "test_variant_sliding_window",
    "test_variant_sliding_window_at_the_edge",
    "test_variant_sliding_window_draft",
    "test_variant_sliding_window_tree_deeper_than_the_window",
    "test_variant_logit_cap",
    "test_variant_sinks",
    "test_variant_non_causal",
    "test_variant_window_and_cap",
    "test_variant_window_and_sinks",
    "test_variant_window_and_non_causal",
    # cache formats (attnhost.testing.cache_conformance): pages for every backend, FP8 unless not declared
    "test_paged_cache[page1]",
    "test_paged_cache[page16]",
    "test_paged_cache[page64]",
    "test_fp8_kv_cache[float8_e4m3fn]",
    "test_fp8_kv_cache[float8_e5m2]",
    # graphs (attnhost.testing.graph_conformance): skipped unless the backend declares cuda_graph
    "test_graph_replays_read_nothing_on_the_host",
    "test_graph_step_compiles_whole_and_keeps_its_storage",
    # production shapes (attnhost.testing.shape_conformance): every backend, at the sizes served models have
    "test_production_shapes[gqa-32-8-d128]",
    "test_production_shapes[gqa-32-4-d64]",
    "test_production_shapes[gqa-16-8-d256]",
)
FLOAT32_NUMERICS = {
    "test_extend_without_prefix",
    "test_extend_with_cached_prefix",
    "test_decode",
    "test_batch_of_requests_with_different_lengths",
    "test_target_verify_chain",
    "test_draft_extend",
    "test_draft_decode_over_branch_rows",
    "test_head_layouts_mha_gqa_mqa[mha-4-4]",
    "test_head_layouts_mha_gqa_mqa[gqa-8-2]",
    "test_head_layouts_mha_gqa_mqa[mqa-8-1]",
    "test_declared_capabilities_are_valid_and_hold",
    "test_save_kv_cache_false_neither_writes_nor_uses_k_v",
    "test_paged_cache[page16]",
    "test_production_shapes[gqa-32-4-d64]",  # the one a Broken class runs
}


@dataclass(frozen=True)
class Outcome:
    status: str  # passed, failed, skipped, error
    message: str


def parse_junit(path: Path) -> dict[tuple[str, str], Outcome]:
    """``{(class name, test name): outcome}`` from pytest's JUnit XML."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
                message = child.get("message", "").removeprefix("Failed: ") + "\n" + (child.text or "")
                break
        results[(case.get("classname", "").rpartition(".")[2], case.get("name", ""))] = Outcome(status, message)
    return results


def run_pytest(
    args: list[str], *, cwd: Path, path_entries: list[Path]
) -> tuple[subprocess.CompletedProcess[str], dict[tuple[str, str], Outcome]]:
    junit = cwd / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(path_entries, {"XDG_CACHE_HOME": str(cwd / "xdg-cache")}),
        # the whole kit against 16 backends: about a minute of CPU, several on a loaded shared machine
        timeout=900,
    )
    assert junit.exists(), proc.stdout + proc.stderr
    return proc, parse_junit(junit)


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("broken-site")
    make_dist(
        site,
        "attnhost-broken",
        "0.1",
        {GROUP: {"broken": "attnhost_broken"}},
        modules={"attnhost_broken": _PLUGIN, "attnhost_broken.impl": _IMPL},
    )
    make_dist(
        site,
        "attnhost-eager",
        "0.1",
        {GROUP: {"eager": "attnhost_eager:EagerBackend"}},
        modules={"attnhost_eager": _EAGER},
    )
    make_dist(
        site,
        "attnhost-nodoc",
        "0.1",
        {GROUP: {"nodoc": "attnhost_nodoc:NoDocstring"}},
        modules={"attnhost_nodoc": _NODOC},
    )
    make_dist(site, "attnhost-typo", "0.1", {GROUP: {"typo": "attnhost_typo"}}, modules={"attnhost_typo": _TYPO})
    return site


@pytest.fixture(scope="module")
def kit_results(broken_site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Outcome]:
    """One pytest run of the kit against every broken backend (one run keeps torch's import cost single)."""
    project = tmp_path_factory.mktemp("author-project")
    (project / "test_kit.py").write_text(_KIT_FILE)
    proc, results = run_pytest([], cwd=project, path_entries=[broken_site])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return results


def outcomes(results: dict[tuple[str, str], Outcome], cls: str) -> dict[str, Outcome]:
    mine = {name: outcome for (klass, name), outcome in results.items() if klass == cls}
    assert set(mine) == set(KIT_TESTS), f"{cls} ran {sorted(mine)}"
    return mine


def failed(results: dict[str, Outcome]) -> set[str]:
    """The tests that failed or errored; a skip (a capability not declared) is neither."""
    return {name for name, outcome in results.items() if outcome.status in ("failed", "error")}


def reported_error(message: str) -> float:
    match = re.search(r"max abs error (\S+) exceeds", message)
    assert match, message
    return float(match.group(1))


def test_kit_has_at_least_ten_tests() -> None:
    names = [name for name in dir(BackendConformance) if name.startswith("test_")]
    assert len(names) >= 10
    assert {name.partition("[")[0] for name in KIT_TESTS} == set(names)


def test_kit_passes_a_correct_installed_backend(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestCorrect")
    # capabilities it does not declare
    skipped = {"test_flat_heads_layout", "test_target_verify_tree", "test_a_query_that_sees_no_key_gets_zeros"}
    skipped |= {name for name in KIT_TESTS if name.startswith("test_mla_")} - {"test_mla_refused_unless_declared"}
    skipped |= {name for name in KIT_TESTS if name.startswith(("test_variant_", "test_fp8_", "test_graph_"))}
    assert {name for name, outcome in results.items() if outcome.status != "passed"} == skipped
    assert {results[name].status for name in skipped} == {"skipped"}


def test_kit_fails_an_output_off_by_a_thousandth(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestOffByAThousandth")
    assert failed(results) == FLOAT32_NUMERICS  # bfloat16's tolerance rightly absorbs 0.1 %
    for name in FLOAT32_NUMERICS:
        message = results[name].message
        assert "exceeds 1e-05 (float32" in message, message
        assert 1e-4 < reported_error(message) < 1e-2, message
    assert re.match(
        r"extend without prefix: max abs error \S+ exceeds 1e-05 \(float32, 8 heads / 2 KV heads, "
        r"layer 0, request \d, token \d+ of \d+, head \d\)",
        results["test_extend_without_prefix"].message,
    )


def test_kit_holds_a_backend_to_the_flat_heads_it_declares(kit_results: dict[tuple[str, str], Outcome]) -> None:
    assert outcomes(kit_results, "TestCorrect")["test_flat_heads_layout"].status == "skipped"
    keeps = outcomes(kit_results, "TestFlatHeads")
    undeclared = {"test_target_verify_tree", "test_a_query_that_sees_no_key_gets_zeros"}  # not declared: skipped
    undeclared |= {n for n in KIT_TESTS if n.startswith(("test_mla_", "test_variant_", "test_fp8_", "test_graph_"))}
    undeclared |= {"test_paged_cache[page1]", "test_paged_cache[page64]"}  # page_sizes_to_test = (16,)
    undeclared |= {"test_production_shapes[gqa-32-8-d128]", "test_production_shapes[gqa-16-8-d256]"}  # likewise
    assert {o.status for name, o in keeps.items() if name not in undeclared} == {"passed"}
    liar = outcomes(kit_results, "TestFlatLiar")
    assert failed(liar) == {"test_flat_heads_layout"}
    assert liar["test_flat_heads_layout"].message.startswith(
        "flat_heads: extend: output shape (25, 8, 32) for a [tokens, num_heads * head_dim] query, expected (25, 256)"
    ), liar["test_flat_heads_layout"].message


def test_kit_catches_a_backend_that_declares_trees_but_ignores_the_mask(
    kit_results: dict[tuple[str, str], Outcome],
) -> None:
    correct = outcomes(kit_results, "TestCorrect")["test_target_verify_tree"]
    assert correct.status == "skipped" and "does not declare tree_mask" in correct.message, correct.message
    liar = outcomes(kit_results, "TestTreeLiar")
    # chains, draft-extend and branch rows are causal: right; a query that should see no key sees itself; the
    # production shapes verify deep trees
    production = "test_production_shapes[gqa-32-4-d64]"  # the one production shape production_shapes_to_test runs
    assert failed(liar) == {"test_target_verify_tree", "test_a_query_that_sees_no_key_gets_zeros", production}
    blind = liar["test_a_query_that_sees_no_key_gets_zeros"].message
    assert re.match(
        r"a query that sees no key \(float32\): backend 'tree_liar' gives values up to \S+ instead of zeros for "
        r"request 0, token 1 \(layer 0\), whose tree row is all False with no prefix",
        blind,
    ), blind
    message = liar["test_target_verify_tree"].message
    assert re.match(
        r"target-verify tree \(float32\), topk 2 and 3: max abs error \S+ exceeds 1e-05 \(float32, 8 heads / 2 KV "
        r"heads, layer 0, request \d, token [2-7] of [68], head \d\)",
        message,
    ), message
    assert reported_error(message) > 1e-2, message  # seeing a sibling's branch is no rounding error


def test_kit_fails_a_backend_that_gives_nan_for_a_query_that_sees_no_key(
    kit_results: dict[tuple[str, str], Outcome],
) -> None:
    """The contract: a query that sees no key gets zeros. A plain softmax over no key is 0/0; the kit says so."""
    results = outcomes(kit_results, "TestNaNTree")
    assert failed(results) == {"test_a_query_that_sees_no_key_gets_zeros"}  # every other tree case is right
    assert results["test_target_verify_tree"].status == "passed"
    message = results["test_a_query_that_sees_no_key_gets_zeros"].message
    assert message.startswith(
        "a query that sees no key (float32): backend 'nan_tree' gives NaN for request 0, token 1 (layer 0), whose "
        "tree row is all False with no prefix, so it sees no key; the contract gives such a query zeros"
    ), message


def test_kit_fails_kv_written_to_the_wrong_slot(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestWrongSlot")
    assert "test_kv_lands_in_the_right_cache_slots" in failed(results)
    message = results["test_kv_lands_in_the_right_cache_slots"].message
    assert re.search(
        r"K/V cache after extend: layer 1 slot \d+ \(out_cache_loc of request 0, token 0\) does not hold "
        r"that token's new K \(max abs diff \S+\); it holds new token 1's K",
        message,
    ), message
    spec_and_wiring = {
        name for name in KIT_TESTS if name.startswith(("test_spec", "test_discovery", "test_target_runner"))
    }
    assert not failed(results) & spec_and_wiring


def test_kit_fails_a_causal_mask_without_the_prefix_offset(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestNoPrefixOffset")
    assert results["test_extend_without_prefix"].status == "passed"
    for name in ("test_extend_with_cached_prefix", "test_decode", "test_bfloat16"):
        assert results[name].status == "failed", name
    assert results["test_extend_with_cached_prefix"].message.startswith("extend with cached prefix: max abs error")
    assert results["test_decode"].message.startswith("decode step 0: max abs error")


def test_kit_fails_a_backend_that_rebinds_module_globals(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestLeakyGlobal")
    assert failed(results) == {"test_nothing_global_changes"}
    message = results["test_nothing_global_changes"].message
    assert "rebinds module globals of attnhost_broken.impl: _LAST_BUILT" in message, message


def test_kit_fails_a_plugin_that_imports_torch_at_discovery(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestEager")
    assert failed(results) == {"test_discovery_imports_neither_torch_nor_the_implementation"}
    message = results["test_discovery_imports_neither_torch_nor_the_implementation"].message
    assert "loading plugin 'eager' imports torch" in message, message
    assert "attnhost_eager.py:2" in message, message  # the line that did it


def test_kit_blames_the_plugin_that_failed_to_load(kit_results: dict[tuple[str, str], Outcome]) -> None:
    """Not 20 times "unknown backend": every test's first line is the plugin's own load error."""
    results = outcomes(kit_results, "TestTypo")
    for name, outcome in results.items():
        assert outcome.status == "error", name
        first = outcome.message.strip().splitlines()[0].removeprefix('failed on setup with "Failed: ')
        assert first.startswith(
            "spec: backend 'typo' is not registered because plugin 'typo' (distribution attnhost-typo 0.1) "
            "failed to load: implements unknown hook 'attnhost_attention_backend'; did you mean "
            "'attnhost_attention_backends'?"
        ), first


def test_kit_labels_name_the_case_that_failed(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestOffByAThousandth")
    # the cached-prefix test fails in its first step, the prefill: it says so under its own name
    assert results["test_extend_with_cached_prefix"].message.startswith(
        "extend with cached prefix: the prefill before it: max abs error"
    )
    assert results["test_decode"].message.startswith("decode: the prefill before it: max abs error")
    assert results["test_declared_capabilities_are_valid_and_hold"].message.startswith(
        "capabilities: declared float32, head dim 32: extend: max abs error"
    )


def test_kit_blames_the_k_v_arguments_only_when_they_were_read(kit_results: dict[tuple[str, str], Outcome]) -> None:
    name = "test_save_kv_cache_false_neither_writes_nor_uses_k_v"
    used = outcomes(kit_results, "TestUsesArguments")
    assert failed(used) == {name}
    assert used[name].message.startswith(
        "save_kv_cache=False: the output attends over the k/v arguments (passed scaled by 100 here), not over "
        "the K/V already in the cache"
    ), used[name].message
    off = outcomes(kit_results, "TestOffByAThousandth")[name].message
    assert off.startswith("save_kv_cache=False: max abs error") and "k/v arguments" not in off, off


def test_kit_says_where_the_k_v_went(kit_results: dict[tuple[str, str], Outcome]) -> None:
    cache = "test_kv_lands_in_the_right_cache_slots"
    zero = outcomes(kit_results, "TestLayerZero")[cache].message
    assert re.search(
        r"K/V cache after extend: layer 1 slot (\d+) \(out_cache_loc of request 0, token 0\) does not hold that "
        r"token's new K \(max abs diff \S+\); that token's K went to layer 0 slot \1 \(layer 1's K/V was "
        r"written into layer 0: pass layer.layer_id to set_kv\)",
        zero,
    ), zero
    rolled = outcomes(kit_results, "TestWrongSlot")[cache].message
    match = re.search(
        r"layer 1 slot (\d+) .*; it holds new token 1's K; that token's K went to layer 1 slot (\d+);", rolled
    )
    assert match and match.group(1) != match.group(2), rolled
    assert "written into layer 0" not in rolled


def test_kit_passes_a_shorthand_class_without_its_own_docstring(kit_results: dict[tuple[str, str], Outcome]) -> None:
    results = outcomes(kit_results, "TestNoDocstring")  # numerics and contract decide (the warning: test_why_not)
    assert failed(results) == set() and results["test_spec_name_and_description"].status == "passed"


def test_kit_checks_declared_capabilities(kit_results: dict[tuple[str, str], Outcome]) -> None:
    caps = "test_declared_capabilities_are_valid_and_hold"
    only32 = outcomes(kit_results, "TestFloat32Only")
    assert failed(only32) == set() and only32["test_bfloat16"].status == "skipped"
    assert "does not declare bfloat16" in only32["test_bfloat16"].message
    half = outcomes(kit_results, "TestBadHalf")
    # the speculative cases run in every declared dtype, so they catch the broken float16 path too
    speculative = {"test_target_verify_chain", "test_draft_extend", "test_draft_decode_over_branch_rows"}
    assert failed(half) == {caps, *speculative} and half["test_bfloat16"].status == "skipped", failed(half)
    assert half[caps].message.startswith("capabilities: declared float16, head dim 32: extend: max abs error")
    assert half["test_target_verify_chain"].message.startswith(
        "target-verify chain (float16): prefill: max abs error"
    ), half["test_target_verify_chain"].message
    bad = outcomes(kit_results, "TestBadCaps")
    assert bad[caps].message.startswith("capabilities: 'bad_caps' declares capabilities = {'dtypes'")
    # a runner refuses it as an engine does (not run on defaults it did not declare): each case that builds one
    # fails naming the declaration
    built = failed(bad) - {caps}
    assert built, failed(bad)
    for name in built:
        assert "declares no usable capabilities" in bad[name].message and "is a dict" in bad[name].message, (
            name,
            bad[name].message,
        )


# -- the pytest plugin ------------------------------------------------------------------


def test_pytest_option_runs_the_suite_in_an_empty_directory(broken_site: Path, tmp_path: Path) -> None:
    proc, results = run_pytest(
        ["--attnhost-backend", "no_prefix_offset", "-k", "extend_with or extend_without"],
        cwd=tmp_path,
        path_entries=[broken_site],
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {name: o.status for (cls, name), o in results.items()} == {
        "test_extend_without_prefix[no_prefix_offset]": "passed",
        "test_extend_with_cached_prefix[no_prefix_offset]": "failed",
    }
    assert "extend with cached prefix: max abs error" in proc.stdout


def test_pytest_option_with_paths_runs_both_and_reports_unknown_names(broken_site: Path, tmp_path: Path) -> None:
    (tmp_path / "test_own.py").write_text("def test_own():\n    pass\n")
    proc, results = run_pytest(
        ["test_own.py", "--attnhost-backend", "correct,nope", "-k", "own or spec_name"],
        cwd=tmp_path,
        path_entries=[broken_site],
    )
    statuses = {name: o.status for (cls, name), o in results.items()}
    assert statuses == {
        "test_own": "passed",
        "test_spec_name_and_description[correct]": "passed",
        "test_spec_name_and_description[nope]": "error",  # the set-up fixture cannot find it
    }, proc.stdout
    assert (
        "unknown attention backend 'nope'"
        in results[("TestBackendConformance", "test_spec_name_and_description[nope]")].message
    )


def test_pytest_plugin_costs_nothing_without_the_option() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        import attnhost.testing.pytest_plugin
        heavy = ("torch", "attnhost.host", "attnhost.testing.conformance")
        print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
        """
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_node_ids_of_a_failing_run_can_be_pasted_back(broken_site: Path, tmp_path: Path) -> None:
    proc, results = run_pytest(
        ["-rf", "--attnhost-backend", "no_prefix_offset", "-k", "cached_prefix or head_layouts"],
        cwd=tmp_path,
        path_entries=[broken_site],
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    printed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    assert len(printed) >= 2 and any("gqa-8-2" in node for node in printed), proc.stdout
    again, rerun = run_pytest(printed, cwd=tmp_path, path_entries=[broken_site])
    assert again.returncode == 1, again.stdout + again.stderr
    expected = {name: o.status for (_, name), o in results.items() if o.status == "failed"}
    assert {name: o.status for (_, name), o in rerun.items()} == expected, again.stdout


@pytest.mark.parametrize("value", ["", "correct,", " , ", "correct,,nope"])
def test_a_blank_backend_name_is_a_usage_error(broken_site: Path, tmp_path: Path, value: str) -> None:
    """Not "no tests ran" (exit 5), which reads as a broken kit: one line naming the option's value, exit 4."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--attnhost-backend", value],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=subprocess_env([broken_site], {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}),
        timeout=120,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"ERROR: --attnhost-backend {value!r}: a blank backend name; give registered names, separated by commas "
        "(e.g. --attnhost-backend torch_native; `attnhost list` shows them)"
    ], proc.stderr


# A backend whose factory module takes long to import and whose first build takes long to return: each waits
# until the kit has named it (a logging handler opens its gate), so no timing decides the test, and without the
# warning the wait ends in an assertion after a minute.
_SLOW_PLUGIN = """\
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [BackendSpec(name="slow", factory="attnhost_slow.impl:SlowBackend", description="a slow factory")]
"""

_SLOW_IMPL = '''\
import slow_gate

assert slow_gate.warned["importing the factory"].wait(60), "no warning named the slow import of the factory"

from attnhost_broken.impl import Correct


class SlowBackend(Correct):
    """Correct numerics; its build waits until the kit has named it."""

    def __init__(self, runner=None):
        super().__init__(runner)
        assert slow_gate.warned["building backend"].wait(60), "no warning named the slow build"
'''

_SLOW_GATE = """\
import threading

warned = {"importing the factory": threading.Event(), "building backend": threading.Event()}
"""

# Loaded with `-p`: the watch's threshold lowered (as tests of discovery's own watch do), and the gates opened by
# the kit's warning, seen on the "attnhost" logger after the kit's own handler has written it to the terminal.
_SLOW_THRESHOLD = """\
import logging

import attnhost.discovery
import slow_gate

attnhost.discovery.SLOW_IMPORT_WARNING_S = 0.5


class _Gate(logging.Handler):
    def emit(self, record):
        for doing, event in slow_gate.warned.items():
            if record.getMessage().startswith("still " + doing):
                event.set()


logging.getLogger("attnhost").addHandler(_Gate())
"""


def test_a_slow_factory_is_named_on_the_terminal_while_pytest_waits(broken_site: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(
        site,
        "attnhost-slow",
        "0.1",
        {GROUP: {"slow": "attnhost_slow"}},
        modules={
            "attnhost_slow": _SLOW_PLUGIN,
            "attnhost_slow.impl": _SLOW_IMPL,
            "slow_gate": _SLOW_GATE,
            "slow_threshold": _SLOW_THRESHOLD,
        },
    )
    project = tmp_path / "project"
    project.mkdir()
    proc, results = run_pytest(
        ["-p", "slow_threshold", "--attnhost-backend", "slow", "-k", "target_runner_builds"],
        cwd=project,
        path_entries=[site, broken_site],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [o.status for o in results.values()] == ["passed"]
    plugin = "plugin 'slow' (distribution attnhost-slow 0.1)"
    hangs = (
        "after 0.5 s; waiting for it — if it hangs, press Ctrl-C: pytest shows where it waits (--full-trace: the "
        "whole stack)"
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("attnhost: warning: ")]
    # on the terminal, not in a captured section: the test passed, so pytest printed no captured output
    assert (
        f"attnhost: warning: still importing the factory 'attnhost_slow.impl:SlowBackend' of backend 'slow' "
        f"({plugin}) {hangs}" in lines
    ), proc.stdout
    assert (
        f"attnhost: warning: still building backend 'slow' ({plugin}) for a target runner: its factory "
        f"'attnhost_slow.impl:SlowBackend' has not returned {hangs}" in lines
    ), proc.stdout
