"""``BackendConformance``: the suite every attention backend plugin should pass.

A plugin author subclasses it in their own tests::

    from attnhost.testing import BackendConformance

    class TestMine(BackendConformance):
        backend_name = "mine"

and runs ``pytest``. Every test goes through the public path a serving engine
uses — the installed plugin, the registry, ``ServerArgs``, a ``ModelRunner``
as target and as draft, ``runner.prepare_batch`` and ``backend.forward`` under
the runner's forward context — so passing means "works when installed", not
"works when imported by hand".

Numerics are compared with :func:`attnhost.testing.reference.reference_attention`
(float64, a naive loop sharing no code with any backend). The reference reads
K/V from a copy of the cache in which the kit itself wrote the new tokens, so
a backend that stores K/V in the wrong place fails the cache test *and*
cannot make its own output look right by reading back its own mistake.

A failure names the property that broke and by how much, e.g.
``extend with cached prefix: max abs error 3.2e-03 exceeds 1e-05 (float32,
8 heads / 2 KV heads, layer 0, request 1, token 4 of 11, head 2)``.

Class attributes an author may override: ``backend_name`` (required),
``expect_draft`` (assert the backend is / is not draft-capable),
``platform`` (resolution platform, default: detected), ``device``,
``float32_atol``/``bfloat16_atol``/``float16_atol``, ``head_dim`` (unless the
backend's declared ``capabilities.head_dims`` exclude it), ``seed`` and
``check_discovery_imports``.

The speculative batches (verify as a chain and as a tree, draft-extend, draft
decode over branch rows that share their request's prefix slots) run in every
float dtype the backend declares; the tree cases, among them a query that sees
no key and must get zeros, only for a backend that declares
``capabilities.tree_mask``. The MLA cases (:mod:`attnhost.testing.mla_conformance`)
run for a backend that declares ``capabilities.mla``. The production-shape cases
(:mod:`attnhost.testing.shape_conformance`) run the kit's checks at the sizes served models have.

A factory whose import or build is still running after
``attnhost.discovery.SLOW_IMPORT_WARNING_S`` (the threshold of ``attnhost
list``'s slow-import warning) is named on the terminal while pytest waits for
it (:mod:`attnhost.testing.watch`): pytest would otherwise show nothing until
the test ends, which for a hung factory is never.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from attnhost.availability import check_availability
from attnhost.backend import (
    FLOAT_DTYPES,
    AttentionBackend,
    BackendCapabilities,
    capabilities_of,
    dtype_name,
)
from attnhost.context import dispatch_attention_backend, get_attn_backend
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.host import default_host, get_registry
from attnhost.platform import current_platform
from attnhost.registry import BackendEntry
from attnhost.resolution import DraftResolution
from attnhost.runner import ModelRunner
from attnhost.testing.cache_conformance import CacheConformance
from attnhost.testing.cases import HEAD_LAYOUTS, SPECULATIVE_TREES
from attnhost.testing.graph_conformance import GraphConformance
from attnhost.testing.harness import LayerRun, Request, fail, same_bits, stored
from attnhost.testing.mla_conformance import MLAConformance
from attnhost.testing.reference import tree_mask
from attnhost.testing.shape_conformance import ShapeConformance
from attnhost.testing.variant_conformance import VariantConformance

__all__ = ["BackendConformance", "ConformanceWarning"]


class ConformanceWarning(UserWarning):
    """What the kit reports without failing (a missing description): pytest lists it in its warnings summary."""


_STAMPS = ("prefill_attention_backend_str", "decode_attention_backend_str")
_MISSING = object()


def _tree_mask(*trees: str) -> torch.Tensor:
    """``ForwardBatch.tree_mask`` for one request per named tree (:data:`SPECULATIVE_TREES`), in order."""
    return tree_mask(*(SPECULATIVE_TREES[name] for name in trees))


# Run in a fresh interpreter, as `attnhost list` would be: load the registry and
# report what that imported. The audit hook records who imported torch first.
_DISCOVERY_PROBE = r"""
import json, sys, traceback
culprit = []
def _hook(event, args):
    if event == "import" and args[0] == "torch" and not culprit:
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<")]
        culprit.extend(f"{f.filename}:{f.lineno}" for f in reversed(frames[-3:]))
sys.addaudithook(_hook)
from attnhost.host import default_host, get_registry
registry = get_registry()
name = registry.canonical(sys.argv[1])
spec = registry[name] if name else None
module = spec.factory_module if spec is not None and isinstance(spec.factory, str) else None
plugins = {p.name: (p.status.value, p.error) for p in default_host().plugins()}
print(json.dumps({
    "found": name is not None,
    "plugins": plugins,
    "torch": "torch" in sys.modules,
    "culprit": culprit,
    "factory_module": module,
    "factory_imported": module is not None and module in sys.modules,
}))
"""


class BackendConformance(MLAConformance, VariantConformance, ShapeConformance, CacheConformance, GraphConformance):
    """Subclass with ``backend_name = "<your backend>"``; pytest then runs the whole suite against it."""

    # -- the spec -----------------------------------------------------------------------

    def test_spec_name_and_description(self) -> None:
        spec = self.entry.spec
        if spec.name != self.name:
            fail(f"spec: registry entry {self.name!r} carries a spec named {spec.name!r}")
        lines = spec.description.strip().splitlines()
        if not lines:  # numerics and the contract decide pass or fail; a missing description is only a warning
            warnings.warn(
                f"backend {self.name!r} has no description (`attnhost list` shows '-'); give BackendSpec a "
                "one-line description= (or the shorthand class a docstring of its own)",
                ConformanceWarning,
                stacklevel=1,
            )
        if len(lines) > 1:
            fail(f"spec: the description of {self.name!r} spans {len(lines)} lines; keep it to one")
        if not spec.implemented:
            fail(f"spec: backend {self.name!r} is declared only (no factory); give its BackendSpec a factory=")

    def test_spec_roles(self) -> None:
        roles = self.entry.roles
        if "target" not in roles:
            fail(f"spec: backend {self.name!r} has roles {roles}, without 'target'")
        registry = get_registry()
        if self.entry.draft != registry.is_draft_capable(self.name):
            fail(f"spec: the registry disagrees with itself on whether {self.name!r} is draft-capable")
        if self.expect_draft is not None and self.entry.draft != self.expect_draft:
            how = (
                "return its name from an @attnhost.hookimpl attnhost_draft_attention_backends() "
                "(the shorthand entry point does this for you)"
                if self.expect_draft
                else "remove it from attnhost_draft_attention_backends()"
            )
            fail(
                f"spec: backend {self.name!r} has roles {', '.join(roles)} "
                f"but expect_draft = {self.expect_draft}; {how}"
            )

    def test_spec_factory_importable_and_available(self) -> None:
        spec = self.entry.spec
        platform = current_platform(self.platform)
        availability = check_availability(self.entry, platform)
        try:
            factory = self._load_factory()
        except Exception as exc:
            if (availability.reason or "").startswith("factory module"):  # the sentence `attnhost list` shows
                fail(f"spec: backend {self.name!r} cannot run: {availability.reason}")
            raise AssertionError(
                f"spec: the factory {spec.factory!r} of {self.name!r} cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc
        if not callable(factory):
            fail(f"spec: the factory of {self.name!r} is {type(factory).__name__}, not callable")
        if not availability.available:
            fail(
                f"spec: backend {self.name!r} is not available on {platform}: {availability.reason} "
                "(set platform = ... on the test class to test another platform's resolution)"
            )

    def test_discovery_imports_neither_torch_nor_the_implementation(self) -> None:
        if not self.check_discovery_imports:
            pytest.skip("check_discovery_imports = False")
        if self.entry.distribution is None:
            pytest.skip(f"backend {self.name!r} was registered in-process; only installed plugins are discovered")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if self.entry.plugin == "builtin":
            env["ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        else:  # load only this plugin: another plugin importing torch is not this one's fault
            env.pop("ATTNHOST_DISABLE_PLUGIN_AUTOLOAD", None)
            env["ATTNHOST_PLUGINS"] = self.entry.plugin
        proc = subprocess.run(
            [sys.executable, "-c", _DISCOVERY_PROBE, self.name],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        if proc.returncode != 0 or not proc.stdout.strip():
            fail(f"discovery: loading the plugins in a fresh interpreter failed:\n{proc.stderr.strip()}")
        report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        if not report["found"]:
            status = report["plugins"].get(self.entry.plugin)
            fail(f"discovery: a fresh interpreter does not find {self.name!r} (plugin {self.entry.plugin!r}: {status})")
        if report["torch"]:
            chain = " <- ".join(report["culprit"]) or "unknown"
            fail(
                f"discovery: loading plugin {self.entry.plugin!r} imports torch ({chain}); `attnhost list` "
                "must stay cheap: point the factory at a separate module ('module:attr') or import torch "
                "inside the backend's methods"
            )
        if report["factory_imported"]:
            fail(
                f"discovery: loading plugin {self.entry.plugin!r} imports its factory module "
                f"{report['factory_module']!r}; keep the plugin module free of implementation imports"
            )

    # -- runners ------------------------------------------------------------------------

    def _check_stamped(self, runner: ModelRunner, role: str) -> None:
        backend = runner.attn_backend
        stamps = tuple(getattr(backend, attr) for attr in _STAMPS)
        if stamps != (self.name, self.name):
            fail(
                f"{role} runner: the backend carries prefill/decode names {stamps}, expected "
                f"({self.name!r}, {self.name!r}); the runner stamps them on the instance, do not overwrite them"
            )
        with runner.forward_context():
            if get_attn_backend() is not backend:
                fail(f"{role} runner: inside its forward context the current backend is not the runner's")
            for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
                chosen = dispatch_attention_backend(mode)
                if chosen != self.name:
                    fail(f"{role} runner: {mode.name} dispatches to {chosen!r}, expected {self.name!r}")

    def test_target_runner_builds_and_stamps_its_backend(self) -> None:
        args = self._args()
        runner = self._runner(args)
        self._check_stamped(runner, "target")
        again = self._runner(args)
        if again.attn_backend is runner.attn_backend:
            fail("target runner: two runners got the same backend instance; the factory must build a new one per call")
        self._forward(runner, ForwardMode.EXTEND, [(runner.new_request(), 0, 7)], "target runner extend", check=False)

    def test_draft_runner_builds_and_stamps_its_backend(self) -> None:
        self._require_draft()
        args = self._args()
        target = self._runner(args)
        draft = self._runner(args, is_draft=True)
        resolution = draft.resolution
        assert isinstance(resolution, DraftResolution)
        if resolution.name != self.name or resolution.fell_back:
            fail(
                f"draft runner: --speculative-draft-attention-backend {self.name} resolved to "
                f"{resolution.name!r}{' (fell back)' if resolution.fell_back else ''}: {'; '.join(resolution.trace)}"
            )
        if draft.attn_backend is target.attn_backend:
            fail("draft runner: target and draft share one backend instance; build a new one per factory call")
        self._check_stamped(draft, "draft")
        request = draft.new_request()
        self._forward(draft, ForwardMode.DRAFT_EXTEND, [(request, 0, 9)], "draft runner extend", check=False)
        self._forward(draft, ForwardMode.DECODE, [(request, 9, 1)], "draft runner decode", check=False)
        with target.forward_context(), draft.forward_context():
            if (
                dispatch_attention_backend(ForwardMode.DECODE) != self.name
                or get_attn_backend() is not draft.attn_backend
            ):
                fail("draft runner: nested inside the target's forward context, dispatch did not reach the draft")

    # -- numerics -----------------------------------------------------------------------

    def test_extend_without_prefix(self) -> None:
        runner = self._runner()
        requests = [(runner.new_request(), 0, n) for n in (37, 1, 8)]
        self._forward(runner, ForwardMode.EXTEND, requests, "extend without prefix")

    def test_extend_with_cached_prefix(self) -> None:
        runner = self._runner()
        r0, r1 = runner.new_request(), runner.new_request()
        self._forward(
            runner, ForwardMode.EXTEND, [(r0, 0, 20), (r1, 0, 9)], "extend with cached prefix: the prefill before it"
        )
        self._forward(runner, ForwardMode.EXTEND, [(r0, 20, 11), (r1, 9, 5)], "extend with cached prefix")
        fragmented = self._fragmented_prefix(runner, 17)
        self._forward(
            runner,
            ForwardMode.EXTEND,
            [(fragmented, 17, 6), (r1, 14, 3)],
            "extend with a cached prefix in non-contiguous slots",
        )

    def test_decode(self) -> None:
        runner = self._runner()
        requests = [runner.new_request() for _ in range(3)]
        lengths = [13, 1, 40]
        self._forward(
            runner,
            ForwardMode.EXTEND,
            [(r, 0, n) for r, n in zip(requests, lengths, strict=True)],
            "decode: the prefill before it",
        )
        for step in range(3):  # each step interleaves the requests' slots, so later reads are gathers
            batch = [(r, n + step, 1) for r, n in zip(requests, lengths, strict=True)]
            self._forward(runner, ForwardMode.DECODE, batch, f"decode step {step}")
        self._forward(runner, ForwardMode.DECODE, [(requests[2], 43, 1)], "decode of a single request")

    def test_batch_of_requests_with_different_lengths(self) -> None:
        runner = self._runner()
        r = [runner.new_request() for _ in range(5)]
        self._forward(
            runner,
            ForwardMode.EXTEND,
            [(r[0], 0, 30), (r[1], 0, 3), (r[4], 0, 64)],
            "batch of different lengths: the prefill before it",
        )
        self._forward(
            runner,
            ForwardMode.MIXED,
            [(r[0], 30, 1), (r[1], 3, 12), (r[2], 0, 25), (r[3], 0, 1), (r[4], 64, 2)],
            "mixed batch of different lengths",
        )
        self._forward(
            runner,
            ForwardMode.TARGET_VERIFY,
            [(r[0], 31, 4), (r[2], 25, 4), (r[4], 66, 4)],
            "target-verify batch (draft tokens after a prefix)",
        )

    # -- speculative batches ----------------------------------------------------------
    # Each case runs in every declared float dtype: the first dtype (float32 when declared) in full, the others
    # their main batch (ragged prefixes, one of them scattered), which keeps the kit quick for 16 backends.

    def test_target_verify_chain(self) -> None:
        """TARGET_VERIFY as a chain (EAGLE topk 1): each request's draft tokens, causal, after its prefix."""
        for dtype, full in self._speculative_dtypes():
            label = f"target-verify chain ({dtype_name(dtype)})"
            runner = self._runner(dtype=dtype)
            r, scattered = self._speculative_prefill(runner, label)
            batch = [(r[0], 13, 4), (r[1], 1, 4), (scattered, 17, 4), (r[2], 30, 4)]
            self._forward(runner, ForwardMode.TARGET_VERIFY, batch, label)
            if full:
                self._forward(runner, ForwardMode.TARGET_VERIFY, [(r[2], 34, 4)], f"{label} of a single request")

    def test_target_verify_tree(self) -> None:
        """TARGET_VERIFY with ``tree_mask`` (EAGLE topk 2 and 3): a draft token sees the prefix and its ancestors."""
        if not self._capabilities().tree_mask:
            pytest.skip(
                f"backend {self.name!r} does not declare tree_mask (capabilities.tree_mask = False): engines send it "
                "speculative chains only and refuse a tree run"
            )
        for dtype, full in self._speculative_dtypes():
            label = f"target-verify tree ({dtype_name(dtype)})"
            runner = self._runner(dtype=dtype)
            r, scattered = self._speculative_prefill(runner, label)
            self._forward(
                runner,
                ForwardMode.TARGET_VERIFY,
                [(r[0], 13, 6), (r[1], 1, 6), (scattered, 17, 8), (r[2], 30, 8)],
                f"{label}, topk 2 and 3",
                tree_mask=_tree_mask("topk2-6-wide", "topk2-6-deep", "topk3-8-deep", "topk3-8-wide"),
            )
            if full:
                self._forward(
                    runner,
                    ForwardMode.TARGET_VERIFY,
                    [(r[0], 19, 6), (r[1], 7, 6)],
                    f"{label}, topk 2",
                    tree_mask=_tree_mask("topk2-6-late-sibling", "topk2-6-wide"),
                )
                self._forward(
                    runner,
                    ForwardMode.TARGET_VERIFY,
                    [(r[2], 38, 4)],
                    f"{label} of a single request, topk 2",
                    tree_mask=_tree_mask("topk2-4"),
                )

    def test_a_query_that_sees_no_key_gets_zeros(self) -> None:
        """A tree row that is all False in a request without a prefix: that query sees no key at all, and the
        contract gives it zeros (a softmax over no key is 0/0, and a NaN would spread through every later layer).

        The batch also holds such a row in a request with a prefix (it sees the prefix: an ordinary output) and a
        lone one-token request whose one-cell block is False (a decode-shaped request that still sees nothing).
        """
        if not self._capabilities().tree_mask:
            pytest.skip(
                f"backend {self.name!r} does not declare tree_mask (capabilities.tree_mask = False): engines never "
                "send it a tree, so no query of its sees no key"
            )
        fresh_block, cached_block = _tree_mask("topk2-4").view(4, 4), _tree_mask("topk2-4").view(4, 4)
        fresh_block[1] = False  # request 0 (no prefix), token 1: sees nothing
        cached_block[2] = False  # request 1 (a prefix of 9), token 2: sees the prefix only
        mask = torch.cat([fresh_block.flatten(), cached_block.flatten(), torch.zeros(1, dtype=torch.bool)])
        blind = {1: (0, 1), 8: (2, 0)}  # token in the batch: (request, token within it), each seeing no key
        for dtype, _ in self._speculative_dtypes():
            label = f"a query that sees no key ({dtype_name(dtype)})"
            runner = self._runner(dtype=dtype)
            fresh, cached, lone = runner.new_request(), runner.new_request(), runner.new_request()
            self._forward(runner, ForwardMode.EXTEND, [(cached, 0, 9)], f"{label}: the prefill before it")
            batch = [(fresh, 0, 4), (cached, 9, 4), (lone, 0, 1)]
            step = self._forward(runner, ForwardMode.TARGET_VERIFY, batch, label, check=False, tree_mask=mask)
            for run in step.layers:
                if tuple(run.out.shape) == (step.batch.num_new_tokens, run.layer.num_heads, run.layer.head_dim):
                    for token, (request, within) in blind.items():
                        got = run.out[token].detach().to("cpu", torch.float64)
                        if bool(torch.isnan(got).any()):
                            wrong = "NaN"
                        elif not bool(torch.isfinite(got).all()):
                            wrong = "inf"
                        elif bool(got.any()):
                            wrong = f"values up to {float(got.abs().max()):.1e} instead of zeros"
                        else:
                            continue
                        fail(
                            f"{label}: backend {self.name!r} gives {wrong} for request {request}, token {within} "
                            f"(layer {run.layer.layer_id}), whose tree row is all False with no prefix, so it sees "
                            "no key; the contract gives such a query zeros: find these rows when planning the batch "
                            "and zero their output (a softmax over no key is 0/0)"
                        )
                self._check_output(label, run, step.batch)

    def test_draft_extend(self) -> None:
        """DRAFT_EXTEND_V2 and DRAFT_EXTEND: the draft catches up on accepted tokens, causally, ragged."""
        for dtype, full in self._speculative_dtypes():
            label = f"draft-extend ({dtype_name(dtype)})"
            runner = self._speculative_runner(dtype)
            r, scattered = self._speculative_prefill(runner, label)
            batch = [(r[0], 13, 3), (r[1], 1, 1), (scattered, 17, 2), (r[2], 30, 4)]
            self._forward(runner, ForwardMode.DRAFT_EXTEND_V2, batch, f"{label} v2")
            if full:
                self._forward(runner, ForwardMode.DRAFT_EXTEND, [(r[0], 16, 4), (scattered, 19, 2)], label)
                self._forward(runner, ForwardMode.DRAFT_EXTEND, [(r[2], 34, 3)], f"{label} of a single request")

    def test_draft_decode_over_branch_rows(self) -> None:
        """Draft DECODE with topk > 1: one batch row per branch; a request's rows share its prefix's slots.

        Backends must not assume that different rows' slots are disjoint: every branch row of a request holds
        the same prefix slots in ``req_to_token``, then slots of its own branch.
        """
        for dtype, full in self._speculative_dtypes():
            label = f"draft decode over branch rows ({dtype_name(dtype)})"
            runner = self._speculative_runner(dtype)
            pool = runner.kv_pool
            first, second = runner.new_request(), runner.new_request()
            self._forward(runner, ForwardMode.EXTEND, [(first, 0, 13), (second, 0, 30)], f"{label}: prefill")
            branches: list[tuple[int, int]] = []  # (row, prefix length)
            for request, prefix_len, topk in ((first, 13, 3), (second, 30, 2)):
                for _ in range(topk):
                    row = runner.new_request()
                    pool.req_to_token[row, :prefix_len] = pool.req_to_token[request, :prefix_len]
                    branches.append((row, prefix_len))
            for step in range(3 if full else 2):  # from step 1 on, a row also reads its own branch's tokens
                rows = [(row, prefix_len + step, 1) for row, prefix_len in branches]
                self._forward(runner, ForwardMode.DECODE, rows, f"{label}, step {step}")

    @pytest.mark.parametrize(("num_heads", "num_kv_heads"), list(HEAD_LAYOUTS.values()), ids=list(HEAD_LAYOUTS))
    def test_head_layouts_mha_gqa_mqa(self, num_heads: int, num_kv_heads: int) -> None:
        runner = self._runner(num_heads=num_heads, num_kv_heads=num_kv_heads)
        self._extend_twice_then_decode(runner, (19, 6), (5, 2), f"{num_heads} query heads / {num_kv_heads} KV heads:")

    def test_bfloat16(self) -> None:
        self._require_dtype(torch.bfloat16)
        self._extend_twice_then_decode(self._runner(dtype=torch.bfloat16), (24, 7), (6, 3), "bfloat16")

    def test_flat_heads_layout(self) -> None:
        """A backend that declares ``flat_heads`` gets SGLang's ``[T, heads * head_dim]`` queries from the bridge."""
        if not self._capabilities().flat_heads:
            pytest.skip(f"backend {self.name!r} does not declare flat_heads: engines pass it [T, heads, head_dim]")
        self._flat_queries = True
        runner = self._runner()
        self._extend_twice_then_decode(runner, (19, 6), (5, 2), "flat_heads:")
        lone = runner.new_request()
        self._forward(runner, ForwardMode.EXTEND, [(lone, 0, 12)], "flat_heads: extend of a single request")
        self._forward(runner, ForwardMode.DECODE, [(lone, 12, 1)], "flat_heads: decode of a single request")
        fragmented = self._fragmented_prefix(runner, 17)
        self._forward(runner, ForwardMode.DECODE, [(fragmented, 17, 1)], "flat_heads: decode over scattered slots")

    def test_declared_capabilities_are_valid_and_hold(self) -> None:
        """What a backend declares, engines act on (dtypes, head dims, CUDA graphs, tree masks), so the kit checks
        it (that declared tree masks hold: ``test_target_verify_tree``)."""
        try:
            factory = self.entry.spec.load()
        except Exception as exc:
            fail(f"capabilities: the factory of {self.name!r} cannot be imported: {type(exc).__name__}: {exc}")
        declared = getattr(factory, "capabilities", None)
        if declared is not None and not isinstance(declared, BackendCapabilities):
            fail(
                f"capabilities: {self.name!r} declares capabilities = {declared!r}, which is not an "
                "attnhost.BackendCapabilities; engines would ignore it"
            )
        capabilities = capabilities_of(factory)
        for flag in ("cuda_graph", "flat_heads", "tree_mask"):
            value = getattr(capabilities, flag)
            if not isinstance(value, bool):
                fail(
                    f"capabilities: {self.name!r} declares {flag} = {value!r}, which is not True or False; "
                    "engines decide on it, so build BackendCapabilities with a bool"
                )
        for name in capabilities.dtypes:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                fail(
                    f"capabilities: {self.name!r} declares dtype {name!r}, which is not a floating torch dtype "
                    f"(use names such as {', '.join(FLOAT_DTYPES)})"
                )
        head_dim = self._head_dim()
        for name in capabilities.dtypes:
            dtype = getattr(torch, name)
            label = f"capabilities: declared {name}, head dim {head_dim}:"
            self._extend_twice_then_decode(self._runner(dtype=dtype), (21, 4), (5, 3), label)

    # -- the cache --------------------------------------------------------------------

    def test_kv_lands_in_the_right_cache_slots(self) -> None:
        runner = self._runner()
        pool = runner.kv_pool
        for layer in runner.layers:  # a non-zero background makes stray writes visible
            pool.k_buffer(layer.layer_id).copy_(self._randn(*pool.k_buffer(0).shape, dtype=pool.dtype))
            pool.v_buffer(layer.layer_id).copy_(self._randn(*pool.v_buffer(0).shape, dtype=pool.dtype))
        r0, r1 = runner.new_request(), runner.new_request()
        plan: list[tuple[ForwardMode, list[Request], str]] = [
            (ForwardMode.EXTEND, [(r0, 0, 5), (r1, 0, 3)], "extend"),
            (ForwardMode.EXTEND, [(r0, 5, 4), (r1, 3, 2)], "extend with cached prefix"),
            (ForwardMode.DECODE, [(r0, 9, 1), (r1, 5, 1)], "decode"),
        ]
        for mode, requests, what in plan:
            batch = self._prepare(runner, mode, requests, what)
            for layer in reversed(runner.layers):  # last layer first: a backend must honour layer.layer_id
                before = [(pool.k_buffer(i).clone(), pool.v_buffer(i).clone()) for i in range(len(runner.layers))]
                table = pool.req_to_token.clone()
                run = self._run_layer(runner, batch, layer, what, check=False)
                self._check_cache(f"K/V cache after {what}", runner, batch, run, before)
                if not torch.equal(pool.req_to_token, table):
                    fail(f"K/V cache after {what}: the backend wrote into req_to_token; only the scheduler may")

    def _check_cache(
        self,
        what: str,
        runner: ModelRunner,
        batch: ForwardBatch,
        run: LayerRun,
        before: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        pool = runner.kv_pool
        layer_id = run.layer.layer_id
        loc = batch.out_cache_loc
        for kind, buffer, new, expected, scale in (
            ("K", pool.k_buffer(layer_id), run.k, run.expected_k, run.layer.k_scale),
            ("V", pool.v_buffer(layer_id), run.v, run.expected_v, run.layer.v_scale),
        ):
            if same_bits(buffer, expected):
                continue
            wrong = (buffer != expected).flatten(1).any(dim=1)
            slot = int(wrong.nonzero()[0])
            change = float((buffer[slot].double() - expected[slot].double()).abs().max())
            positions = (loc == slot).nonzero()
            if positions.numel():
                token = int(positions[0])
                request = bisect.bisect_right(batch.extend_start_loc_cpu, token) - 1
                within = token - batch.extend_start_loc_cpu[request]
                holder = next(
                    (
                        f"; it holds new token {int(i)}'s {kind}"
                        for i in range(new.shape[0])
                        if same_bits(buffer[slot], stored(new[i], scale, pool.dtype))
                    ),
                    "",
                )
                went = _where_it_went(pool, len(runner.layers), stored(new[token], scale, pool.dtype), kind)
                went_text = f"; that token's {kind} went to {went}" if went else f"; that token's {kind} is nowhere"
                if went and all(place.startswith("layer 0 ") for place in went.split(" and ")) and layer_id != 0:
                    went_text += f" (layer {layer_id}'s K/V was written into layer 0: pass layer.layer_id to set_kv)"
                fail(
                    f"{what}: layer {layer_id} slot {slot} (out_cache_loc of request {request}, token {within}) "
                    f"does not hold that token's new {kind} (max abs diff {change:.1e}){holder}{went_text}; write "
                    "with kv_pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)"
                )
            fail(
                f"{what}: layer {layer_id} slot {slot}, which is not in out_cache_loc, was overwritten in {kind} "
                f"(max abs change {change:.1e}); a backend writes only the batch's out_cache_loc slots"
            )
        for other, (k, v) in enumerate(before):
            if other != layer_id and not (same_bits(pool.k_buffer(other), k) and same_bits(pool.v_buffer(other), v)):
                fail(f"{what}: running layer {layer_id} changed layer {other}'s cache; use layer.layer_id")

    def test_save_kv_cache_false_neither_writes_nor_uses_k_v(self) -> None:
        runner = self._runner()
        pool = runner.kv_pool
        request = runner.new_request()
        self._forward(runner, ForwardMode.EXTEND, [(request, 0, 12)], "save_kv_cache=False: the prefill", check=False)
        batch = self._prepare(runner, ForwardMode.EXTEND, [(request, 12, 4)], "save_kv_cache=False")
        layer = runner.layers[0]
        q = self._randn(4, layer.num_heads, layer.head_dim, dtype=runner.dtype)
        k = self._randn(4, layer.num_kv_heads, layer.head_dim, dtype=runner.dtype)
        v = self._randn(4, layer.num_kv_heads, layer.head_dim, dtype=runner.dtype)
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)  # the caller already stored them
        snapshot = pool.k_buffer(layer.layer_id).clone(), pool.v_buffer(layer.layer_id).clone()
        what = "save_kv_cache=False"
        out = self._call(runner, q, k * 100, v * 100, layer, batch, what, save_kv_cache=False)
        if not (torch.equal(pool.k_buffer(0), snapshot[0]) and torch.equal(pool.v_buffer(0), snapshot[1])):
            fail(f"{what}: the backend wrote K/V into the cache although save_kv_cache=False")
        run = LayerRun(layer, q, k, v, out, snapshot[0], snapshot[1])
        problem = self._output_error(run, batch)
        if problem is None:
            return
        # Blame the k/v arguments only if the output is what attending over them would give.
        from_arguments_k, from_arguments_v = snapshot[0].clone(), snapshot[1].clone()
        from_arguments_k[batch.out_cache_loc] = (k * 100).to(pool.dtype)
        from_arguments_v[batch.out_cache_loc] = (v * 100).to(pool.dtype)
        if self._output_error(run, batch, k_buffer=from_arguments_k, v_buffer=from_arguments_v) is None:
            fail(
                f"{what}: the output attends over the k/v arguments (passed scaled by 100 here), not over the "
                "K/V already in the cache; with save_kv_cache=False the caller has stored them: read every key "
                "and value through kv_pool.req_to_token"
            )
        fail(f"{what}: {problem}")

    def test_idle_batch_gives_an_empty_output(self) -> None:
        runner = self._runner()
        batch = self._prepare(runner, ForwardMode.IDLE, [], "idle batch")
        layer = runner.layers[0]
        empty_q = self._randn(0, layer.num_heads, layer.head_dim, dtype=runner.dtype)
        empty_kv = self._randn(0, layer.num_kv_heads, layer.head_dim, dtype=runner.dtype)
        out = self._call(runner, empty_q, empty_kv, empty_kv, layer, batch, "idle batch")
        if tuple(out.shape) != (0, layer.num_heads, layer.head_dim):
            fail(f"idle batch: output shape {tuple(out.shape)}, expected (0, {layer.num_heads}, {layer.head_dim})")

    # -- isolation ----------------------------------------------------------------------

    def test_runners_are_isolated(self) -> None:
        args = self._args()
        first = self._runner(args)
        second = self._runner(args)
        runners = [first, second] + ([self._runner(args, is_draft=True)] if self.entry.draft else [])
        if len({id(r.attn_backend) for r in runners}) != len(runners):
            fail("isolation: two runners share a backend instance")
        request = first.new_request()
        self._forward(first, ForwardMode.EXTEND, [(request, 0, 10)], "isolation: first runner", check=False)
        caches = [(r.kv_pool.k_buffer(0).clone(), r.kv_pool.v_buffer(0).clone()) for r in runners]
        for i, runner in enumerate(runners[1:], 1):
            self._forward(
                runner, ForwardMode.EXTEND, [(runner.new_request(), 0, 6)], f"isolation: {runner.role} {i}", check=False
            )
            for j, other in enumerate(runners):
                k, v = caches[j]
                if j != i and not (
                    torch.equal(other.kv_pool.k_buffer(0), k) and torch.equal(other.kv_pool.v_buffer(0), v)
                ):
                    fail(f"isolation: a forward on runner {i} ({runner.role}) changed runner {j}'s KV cache")
            caches[i] = (runner.kv_pool.k_buffer(0).clone(), runner.kv_pool.v_buffer(0).clone())
        # the first runner's batch state must survive the others' forwards (per-backend metadata)
        self._forward(
            first, ForwardMode.DECODE, [(request, 10, 1)], "isolation: first runner after the others ran", check=False
        )
        for i, runner in enumerate(runners):
            self._check_stamped(runner, f"isolation: runner {i} ({runner.role})")

    def test_nothing_global_changes(self) -> None:
        # Warm up first: one-time lazy initialisation (a kernel cache, a lazy import) is allowed.
        warm = self._runner()
        self._forward(warm, ForwardMode.EXTEND, [(warm.new_request(), 0, 5)], "warm-up", check=False)
        registry = get_registry()
        names, draft_names = registry.names(), registry.names("draft")
        plugins = default_host().plugins()
        environ = _environment()
        torch_state = _torch_globals()
        base_stamps = tuple(getattr(AttentionBackend, attr) for attr in _STAMPS)
        backend_class = type(warm.attn_backend)
        class_stamps = {attr: vars(backend_class).get(attr, _MISSING) for attr in _STAMPS}
        module = _factory_module(self.entry, backend_class)
        module_globals = dict(vars(module)) if module is not None else {}
        warm_cache = warm.kv_pool.k_buffer(0).clone()

        args = self._args()
        frozen = dataclasses.astuple(args)
        target = self._runner(args)
        draft = self._runner(args, is_draft=True) if self.entry.draft else None
        for runner in (target, draft):
            if runner is not None:
                request = runner.new_request()
                self._forward(runner, ForwardMode.EXTEND, [(request, 0, 8)], f"{runner.role} extend", check=False)
                self._forward(runner, ForwardMode.DECODE, [(request, 8, 1)], f"{runner.role} decode", check=False)

        if dataclasses.astuple(args) != frozen:
            fail(f"global state: the ServerArgs changed from {frozen} to {dataclasses.astuple(args)}")
        if get_registry() is not registry or registry.names() != names or registry.names("draft") != draft_names:
            fail("global state: the backend registry changed while runners were built")
        if default_host().plugins() != plugins:
            fail("global state: the set of loaded plugins changed while runners were built")
        stamps = tuple(getattr(AttentionBackend, attr) for attr in _STAMPS)
        if stamps != base_stamps:
            fail(f"global state: AttentionBackend's class attributes {_STAMPS} became {stamps}; stamp instances only")
        for attr, value in class_stamps.items():
            now = vars(backend_class).get(attr, _MISSING)
            if now is not value:
                fail(f"global state: {backend_class.__qualname__}.{attr} was set to {now!r} on the class")
        if module is not None:
            changed = sorted(
                key
                for key in set(module_globals) | set(vars(module))
                if vars(module).get(key, _MISSING) is not module_globals.get(key, _MISSING)
            )
            if changed:
                fail(
                    f"global state: building runners rebinds module globals of {module.__name__}: "
                    f"{', '.join(changed)}; keep per-runner state on the backend instance"
                )
        now_torch = _torch_globals()
        if now_torch != torch_state:
            diff = {k: (torch_state[k], now_torch[k]) for k in torch_state if torch_state[k] != now_torch[k]}
            fail(f"global state: torch settings changed (before, after): {diff}")
        if _environment() != environ:
            now_environ = _environment()
            keys = sorted(set(environ) ^ set(now_environ) | {k for k in environ if now_environ.get(k) != environ[k]})
            fail(f"global state: environment variables changed: {', '.join(keys)}")
        if not torch.equal(warm.kv_pool.k_buffer(0), warm_cache):
            fail("global state: other runners' forwards changed an earlier runner's KV cache")
        self._check_stamped(warm, "global state: the earlier runner")


def _torch_globals() -> dict[str, object]:
    """The process-wide torch settings a backend might be tempted to flip."""
    return {
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _environment() -> dict[str, str]:
    """``os.environ`` without pytest's own bookkeeping variables."""
    return {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}


def _factory_module(entry: BackendEntry, backend_class: type) -> ModuleType | None:
    name = entry.spec.factory_module or backend_class.__module__
    return sys.modules.get(name)


def _where_it_went(pool: Any, num_layers: int, value: torch.Tensor, kind: str) -> str:
    """``layer 0 slot 12``: every place in the cache that holds ``value`` (one token's new K or V)."""
    places = []
    for layer_id in range(num_layers):
        buffer = pool.k_buffer(layer_id) if kind == "K" else pool.v_buffer(layer_id)
        slots = (buffer == value).flatten(1).all(dim=1).nonzero().flatten().tolist()
        places += [f"layer {layer_id} slot {slot}" for slot in slots[:3]]
    return " and ".join(places)
