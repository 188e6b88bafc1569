"""The conformance kit's attention-variant checks (docs/variants.md), mixed into ``BackendConformance``.

Each case runs only for a backend that declares the capability flags it needs (``sliding_window``, ``logit_cap``,
``sinks``, ``non_causal``); for one that does not, it skips with a reason naming the flag, since engines refuse
such models when they load them. A case runs in every float dtype the backend declares (the first one in full,
the others its main batches), through the public path of every other case (``ModelRunner``, ``prepare_batch``,
``backend.forward`` in the runner's forward context), with the runner's two layers rebuilt with the variant (each
layer its own window or cap, as Gemma alternates them), and compares each output with
:func:`attnhost.testing.reference.reference_attention` in float64 at the kit's tolerances:

* **sliding window**: windows shorter and longer than the prefix (and ``0``: a query sees only itself); prefill,
  extend over a cached prefix that crosses the window (contiguous and scattered), mixed batches, decode of many
  requests and of one, decode exactly at the window's edge (``seq_len == w + 1`` and ``w + 2``), and the
  speculative batches: verify as a chain and (with ``tree_mask``) as a tree, a window shorter than the tree's
  depth included, draft extend and draft decode over branch rows;
* **logit soft-cap** (scores ``cap * tanh(s / cap)``), **sinks** (their tree case keeps a query that sees no key
  at zeros) and **non-causal** layers (a tree batch over one must be refused, not computed) over prefill,
  cached prefixes, decode and the speculative batches;
* the combinations models use: window + cap (Gemma 2), window + sinks (gpt-oss), window + non-causal (DFlash).

A failure names the case and the layer's variant, e.g. ``sliding window (float32), sliding_window_size=7 and 40:
decode at the window's edge (seq_len = w + 1): max abs error 3.1e-01 exceeds 1e-05 (float32, 8 heads / 2 KV
heads, layer 0, request 0, token 0 of 1, head 5)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch

from attnhost.forward_mode import ForwardMode
from attnhost.testing.cases import SPECULATIVE_TREES
from attnhost.testing.harness import ConformanceHarness, Request
from attnhost.testing.reference import tree_mask

if TYPE_CHECKING:
    from attnhost.backend import AttentionLayer
    from attnhost.runner import ModelRunner

__all__ = ["VariantConformance"]


def _tree(*names: str) -> torch.Tensor:
    return tree_mask(*(SPECULATIVE_TREES[name] for name in names))


class VariantConformance(ConformanceHarness):
    """The attention-variant cases of the conformance kit; ``BackendConformance`` inherits them."""

    variant_windows: ClassVar[tuple[int, int]] = (7, 40)
    """``sliding_window_size`` of the runner's two layers: one shorter than most prefixes, one longer."""
    variant_caps: ClassVar[tuple[float, float]] = (3.0, 5.0)
    """``logit_cap`` of the two layers: small enough to bend the kit's scores (about unit variance), and not 2, at
    which ``cap * tanh(score)`` (the division left out) equals a doubled scale under the cap, so the kit could not
    tell the two mistakes apart."""

    # -- set-up ---------------------------------------------------------------------

    def _require_variants(self, *flags: str) -> None:
        """Skip, naming the first of ``flags`` (``BackendCapabilities`` fields) the backend does not declare."""
        capabilities = self._capabilities()
        for flag in flags:
            if not getattr(capabilities, flag):
                consequence = (
                    "engines send it speculative chains only and refuse a tree run"
                    if flag == "tree_mask"
                    else "engines refuse models whose layers need it when they load them"
                )
                pytest.skip(
                    f"backend {self.name!r} does not declare {flag} (capabilities.{flag} = False): {consequence}"
                )

    @staticmethod
    def _variant_layers(runner: ModelRunner, *per_layer: dict[str, Any]) -> tuple[AttentionLayer, ...]:
        """The runner's layers, layer ``i`` rebuilt with ``per_layer[i]`` (the last one for the rest)."""
        return tuple(
            dataclasses.replace(layer, **per_layer[min(i, len(per_layer) - 1)]) for i, layer in enumerate(runner.layers)
        )

    @staticmethod
    def _variant_label(case: str, dtype: torch.dtype, layers: Sequence[AttentionLayer]) -> str:
        """``"sliding window (float32), sliding_window_size=7 and 40"``: the case and its layers' variants."""
        texts = []
        for feature in dict.fromkeys(f for layer in layers for f in layer.variant_features):
            values = dict.fromkeys(layer.variant_text(feature) for layer in layers if feature in layer.variant_features)
            field, *rest = [text.partition("=") for text in values]
            texts.append(f"{field[0]}={field[2]}" + "".join(f" and {value}" for _, _, value in rest))
        return f"{case} ({str(dtype).removeprefix('torch.')}), {', '.join(texts)}"

    def _variant_numerics(self, case: str, *per_layer: dict[str, Any], speculative: bool = True) -> None:
        """The common batches of a variant case in every declared float dtype (:meth:`_variant_batches`)."""
        for dtype, full in self._speculative_dtypes():
            runner = self._runner(dtype=dtype)
            layers = self._variant_layers(runner, *per_layer)
            self._variant_batches(runner, layers, self._variant_label(case, dtype, layers), full, speculative)

    def _variant_batches(
        self, runner: ModelRunner, layers: Sequence[AttentionLayer], label: str, full: bool, speculative: bool
    ) -> None:
        """Prefill, cached prefixes (contiguous and scattered), decode of many requests and of one; then, when
        ``full``, an extend of one request, a mixed batch and (``speculative``) a verify chain, a verify tree (where
        ``tree_mask`` is declared) and a draft extend."""

        def step(mode: ForwardMode, requests: Sequence[Request], what: str, tree: torch.Tensor | None = None) -> None:
            self._forward(runner, mode, requests, f"{label}: {what}", tree_mask=tree, layers=layers)

        r = [runner.new_request() for _ in range(4)]
        step(ForwardMode.EXTEND, [(r[0], 0, 30), (r[1], 0, 5), (r[2], 0, 1), (r[3], 0, 50)], "prefill")
        scattered = self._fragmented_prefix(runner, 17)
        step(ForwardMode.EXTEND, [(r[0], 30, 11), (r[1], 5, 9), (scattered, 17, 6)], "extend with cached prefix")
        step(ForwardMode.DECODE, [(r[0], 41, 1), (r[1], 14, 1), (r[2], 1, 1), (scattered, 23, 1)], "decode")
        step(ForwardMode.DECODE, [(r[3], 50, 1)], "decode of a single request")
        if not full:
            return
        step(ForwardMode.EXTEND, [(r[3], 51, 24)], "extend of a single request with a cached prefix")
        step(ForwardMode.MIXED, [(r[0], 42, 1), (r[1], 15, 7), (r[2], 2, 1), (scattered, 24, 3)], "mixed batch")
        if not speculative:
            return
        step(ForwardMode.TARGET_VERIFY, [(r[0], 43, 4), (r[1], 22, 4), (scattered, 27, 4)], "target-verify chain")
        if self._capabilities().tree_mask:
            step(
                ForwardMode.TARGET_VERIFY,
                [(r[0], 43, 6), (r[2], 3, 8), (scattered, 27, 8)],
                "target-verify tree, topk 2 and 3",
                _tree("topk2-6-deep", "topk3-8-deep", "topk3-8-wide"),
            )
        step(ForwardMode.DRAFT_EXTEND_V2, [(r[0], 43, 3), (r[1], 22, 1), (scattered, 27, 2)], "draft-extend v2")

    # -- the cases --------------------------------------------------------------------

    def test_variant_sliding_window(self) -> None:
        """Windows shorter and longer than the prefix over prefill, cached prefixes, mixed, decode and verify."""
        self._require_variants("sliding_window")
        short, long = self.variant_windows
        self._variant_numerics("sliding window", {"sliding_window_size": short}, {"sliding_window_size": long})

    def test_variant_sliding_window_at_the_edge(self) -> None:
        """Decode exactly at the window's edge: ``seq_len == w + 1`` (the query sees every key) and ``w + 2`` (the
        first key just left the window), one request alone and several at once; and ``w = 0`` (itself only)."""
        self._require_variants("sliding_window")
        w = 9
        for dtype, full in self._speculative_dtypes():
            runner = self._runner(dtype=dtype)
            layers = self._variant_layers(runner, {"sliding_window_size": w}, {"sliding_window_size": 0})
            label = self._variant_label("sliding window at its edge", dtype, layers)
            r = [runner.new_request() for _ in range(3)]
            # the prefill runs the runner's plain layers: the case is the decode at the edge, so it fails there
            prefill = [(r[0], 0, w), (r[1], 0, w + 1), (r[2], 0, w)]
            self._forward(runner, ForwardMode.EXTEND, prefill, f"{label}: prefill (plain layers)")
            what = f"{label}: decode at the window's edge (seq_len = w + 1 and w + 2)"
            self._forward(runner, ForwardMode.DECODE, [(r[0], w, 1), (r[1], w + 1, 1)], what, layers=layers)
            what = f"{label}: decode just past the window's edge (seq_len = w + 2), a single request"
            self._forward(runner, ForwardMode.DECODE, [(r[0], w + 1, 1)], what, layers=layers)
            if full:  # a request prefilled and decoded alone: its slots are one run (a backend may read a view)
                alone = runner.new_request()
                self._forward(runner, ForwardMode.EXTEND, [(alone, 0, w)], f"{label}: prefill of a single request")
                for seq_len in (w + 1, w + 2):
                    what = f"{label}: decode at seq_len = w + {seq_len - w}, a single request whose slots are one run"
                    self._forward(runner, ForwardMode.DECODE, [(alone, seq_len - 1, 1)], what, layers=layers)
                what = f"{label}: extend whose queries cross the window's edge"
                batch = [(r[1], w + 2, 3), (r[2], w, w + 2)]
                self._forward(runner, ForwardMode.EXTEND, batch, what, layers=layers)

    def test_variant_sliding_window_draft(self) -> None:
        """The draft's batches with a window: draft extend (v1 and v2) and draft decode over branch rows (rows that
        share their request's prefix slots), with a window shorter than the prefix."""
        self._require_variants("sliding_window")
        for dtype, full in self._speculative_dtypes():
            runner = self._speculative_runner(dtype)
            layers = self._variant_layers(runner, {"sliding_window_size": 5}, {"sliding_window_size": 16})
            label = self._variant_label("sliding window in the draft", dtype, layers)
            r = [runner.new_request() for _ in range(3)]
            self._forward(
                runner,
                ForwardMode.EXTEND,
                [(r[0], 0, 13), (r[1], 0, 1), (r[2], 0, 30)],
                f"{label}: prefill",
                layers=layers,
            )
            batch = [(r[0], 13, 3), (r[1], 1, 1), (r[2], 30, 4)]
            self._forward(runner, ForwardMode.DRAFT_EXTEND_V2, batch, f"{label}: draft-extend v2", layers=layers)
            if full:
                self._forward(
                    runner, ForwardMode.DRAFT_EXTEND, [(r[2], 34, 3)], f"{label}: draft-extend", layers=layers
                )
            pool, branches = runner.kv_pool, []
            for request, prefix_len, topk in ((r[0], 16, 3), (r[2], 30 + 4 + (3 if full else 0), 2)):
                for _ in range(topk):
                    row = runner.new_request()
                    pool.req_to_token[row, :prefix_len] = pool.req_to_token[request, :prefix_len]
                    branches.append((row, prefix_len))
            for step in range(2):
                rows = [(row, prefix_len + step, 1) for row, prefix_len in branches]
                what = f"{label}: draft decode over branch rows, step {step}"
                self._forward(runner, ForwardMode.DECODE, rows, what, layers=layers)

    def test_variant_sliding_window_tree_deeper_than_the_window(self) -> None:
        """A speculative tree with windows shorter than its depth: a deep draft token no longer sees the root
        (positions in a tree are the prefix plus the depth, not the index)."""
        self._require_variants("sliding_window", "tree_mask")
        for dtype, _ in self._speculative_dtypes():
            runner = self._runner(dtype=dtype)
            layers = self._variant_layers(runner, {"sliding_window_size": 2}, {"sliding_window_size": 0})
            label = self._variant_label("sliding window over a deep tree", dtype, layers)
            r, scattered = self._speculative_prefill(runner, f"{label}: prefill")
            self._forward(
                runner,
                ForwardMode.TARGET_VERIFY,
                [(r[0], 13, 6), (r[1], 1, 8), (scattered, 17, 6)],
                f"{label}: target-verify tree",
                tree_mask=_tree("topk2-6-deep", "topk3-8-deep", "topk2-6-late-sibling"),
                layers=layers,
            )

    def test_variant_logit_cap(self) -> None:
        """Scores soft-capped as ``cap * tanh(score / cap)`` before the softmax, in every forward mode."""
        self._require_variants("logit_cap")
        first, second = self.variant_caps
        self._variant_numerics("logit soft-cap", {"logit_cap": first}, {"logit_cap": second})

    def test_variant_sinks(self) -> None:
        """Attention sinks (a ``[num_heads]`` logit in each head's softmax denominator) in every forward mode; in a
        tree, a query that sees no key still gets zeros."""
        self._require_variants("sinks")
        self._variant_numerics("attention sinks", {"has_sinks": True})
        if self._capabilities().tree_mask:
            self._blind_queries_with_sinks()

    def _blind_queries_with_sinks(self) -> None:
        block = _tree("topk2-4").view(4, 4).clone()
        block[1] = False  # request 0 (no prefix), token 1: sees no key, sinks or not
        mask = torch.cat([block.flatten(), block.flatten(), torch.zeros(1, dtype=torch.bool)])
        blind = {1: (0, 1), 8: (2, 0)}  # token in the batch: (request, token within it)
        for dtype, _ in self._speculative_dtypes():
            runner = self._runner(dtype=dtype)
            layers = self._variant_layers(runner, {"has_sinks": True})
            label = self._variant_label("a query that sees no key", dtype, layers)
            fresh, cached, lone = runner.new_request(), runner.new_request(), runner.new_request()
            self._forward(runner, ForwardMode.EXTEND, [(cached, 0, 9)], f"{label}: prefill", layers=layers)
            batch = [(fresh, 0, 4), (cached, 9, 4), (lone, 0, 1)]
            step = self._forward(
                runner, ForwardMode.TARGET_VERIFY, batch, label, check=False, tree_mask=mask, layers=layers
            )
            for run in step.layers:
                for token, (request, within) in blind.items():
                    got = run.out.reshape(step.batch.num_new_tokens, -1)[token].detach().to("cpu", torch.float64)
                    finite = bool(torch.isfinite(got).all())
                    if finite and not bool(got.any()):
                        continue
                    pytest.fail(
                        f"{label}: backend {self.name!r} gives {'non-zero values' if finite else 'NaN or inf'} "
                        f"for request {request}, token {within} (layer {run.layer.layer_id}), which sees no key; the "
                        "contract gives such a query zeros with sinks too (the sink takes mass, it has no value)",
                        pytrace=False,
                    )
                self._check_output(label, run, step.batch)

    def test_variant_non_causal(self) -> None:
        """A non-causal layer: a request's new tokens see each other both ways, over prefill, cached prefixes,
        decode and draft extend; a speculative tree over it is refused, not computed."""
        self._require_variants("non_causal")
        self._variant_numerics("non-causal", {"is_causal": False}, speculative=False)
        for dtype, full in self._speculative_dtypes():
            runner = self._speculative_runner(dtype)
            layers = self._variant_layers(runner, {"is_causal": False})
            label = self._variant_label("non-causal in the draft", dtype, layers)
            r = [runner.new_request() for _ in range(2)]
            self._forward(runner, ForwardMode.EXTEND, [(r[0], 0, 11), (r[1], 0, 4)], f"{label}: prefill", layers=layers)
            batch = [(r[0], 11, 5), (r[1], 4, 8)]
            self._forward(runner, ForwardMode.DRAFT_EXTEND_V2, batch, f"{label}: draft-extend v2", layers=layers)
            if full and self._capabilities().tree_mask:
                self._non_causal_tree_refused(dtype)

    def _non_causal_tree_refused(self, dtype: torch.dtype) -> None:
        runner = self._runner(dtype=dtype)
        layer = self._variant_layers(runner, {"is_causal": False})[0]
        request = runner.new_request()
        self._forward(runner, ForwardMode.EXTEND, [(request, 0, 5)], "non-causal tree: prefill", check=False)
        batch = runner.prepare_batch(ForwardMode.TARGET_VERIFY, [(request, 5, 4)], _tree("topk2-4"))
        q = self._randn(4, layer.num_heads, layer.head_dim, dtype=dtype)
        k = self._randn(4, layer.num_kv_heads, layer.head_dim, dtype=dtype)
        try:
            with torch.no_grad(), runner.forward_context() as backend:
                backend.forward(q, k, k.clone(), layer, batch)
        except Exception:
            return
        pytest.fail(
            f"non-causal tree: backend {self.name!r} attended a speculative tree (TARGET_VERIFY with tree_mask) over "
            f"a non-causal layer (layer {layer.layer_id}, is_causal=False); a tree has no meaning there, so the "
            "contract refuses it (docs/variants.md): raise a ValueError naming the layer",
            pytrace=False,
        )

    def test_variant_window_and_cap(self) -> None:
        """Gemma 2's layers: a window and a soft-cap together."""
        self._require_variants("sliding_window", "logit_cap")
        short, long = self.variant_windows
        first, second = self.variant_caps
        self._variant_numerics(
            "window and soft-cap",
            {"sliding_window_size": short, "logit_cap": first},
            {"sliding_window_size": long, "logit_cap": second},
        )

    def test_variant_window_and_sinks(self) -> None:
        """gpt-oss's layers: a window and sinks together (and a layer with sinks and no window beside it)."""
        self._require_variants("sliding_window", "sinks")
        self._variant_numerics("window and sinks", {"sliding_window_size": 6, "has_sinks": True}, {"has_sinks": True})

    def test_variant_window_and_non_causal(self) -> None:
        """DFlash drafts' layers: a window that limits only the left side of a non-causal layer."""
        self._require_variants("sliding_window", "non_causal")
        short = self.variant_windows[0]
        self._variant_numerics(
            "window and non-causal",
            {"sliding_window_size": short, "is_causal": False},
            {"sliding_window_size": 3, "is_causal": False},
            speculative=False,
        )
