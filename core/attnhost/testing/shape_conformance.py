"""The conformance kit's production-shape cases, mixed into ``BackendConformance``.

The kit's other cases keep their shapes small (a head dim of 32, 8 heads, a few requests of a few dozen tokens), so
a failure is quick to read; but a backend can be right there and wrong where production runs: head dims of 128 or
256, 32 heads, contexts of thousands of tokens, batches of dozens of requests on high request rows, SGLang's int32
request table, a cache allocated in one piece (strided K and V views), slots past 32,767, queries and keys that are
views of one projection's output, long windows, soft-caps of tens, deep speculative trees, a third layer. Each
case of :data:`attnhost.testing.cases.PRODUCTION_SHAPES` stands for one served model and together they reach every
one of those at least once; each is a fixed, seeded case, so a failure's node id (``test_production_shapes[NAME-
gqa-32-8-d128]``) is its reproduction, pasted back into ``pytest --attnhost-backend``.

A case runs in the backend's first declared float dtype (float32 when declared), at a page size it declares, with
the layer variants of its model that the backend declares (one it does not declare is left out and the label says
so: engines refuse such a model for it); a case whose head dim the backend does not declare skips, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import pytest
import torch

from attnhost.backend import dtype_name
from attnhost.forward_mode import ForwardMode
from attnhost.testing.cases import PRODUCTION_SHAPES, SPECULATIVE_TREES, ProductionShape
from attnhost.testing.harness import ConformanceHarness, Request
from attnhost.testing.reference import tree_mask

if TYPE_CHECKING:
    from attnhost.backend import AttentionLayer
    from attnhost.runner import ModelRunner

__all__ = ["ShapeConformance"]

HIGH_SLOT = 32768
"""The first slot a signed 16-bit index cannot hold: a ``high_slots`` case's requests sit on both sides of it."""
_FLAGS = {"sliding_window_size": "sliding_window", "logit_cap": "logit_cap", "has_sinks": "sinks"}
"""Each layer field a production shape sets, and the capability flag a backend declares to be given it."""
_VERIFY_TREE = "topk2-10-deep7"
_CHAIN = 4


class ShapeConformance(ConformanceHarness):
    """The production-shape cases of the conformance kit; ``BackendConformance`` inherits them."""

    production_shapes_to_test: ClassVar[tuple[str, ...]] = tuple(PRODUCTION_SHAPES)
    """The ids of :data:`PRODUCTION_SHAPES` to run (the others skip, saying so): all of them, unless a suite that
    runs the kit against many backends needs only one to see each one's mistake."""

    @pytest.mark.parametrize("shape_id", list(PRODUCTION_SHAPES), ids=list(PRODUCTION_SHAPES))
    def test_production_shapes(self, shape_id: str) -> None:
        """A served model's attention at its real sizes: an extend of a dozen requests (prefills, a long chunk over
        a cached prefix, contexts of thousands), a decode of every request, a target-verify of every other one."""
        if shape_id not in self.production_shapes_to_test:
            pytest.skip(f"production shape {shape_id} is not in production_shapes_to_test")
        shape = PRODUCTION_SHAPES[shape_id]
        capabilities = self._capabilities()
        if capabilities.head_dims and shape.head_dim not in capabilities.head_dims:
            pytest.skip(
                f"backend {self.name!r} does not declare head dim {shape.head_dim} (capabilities.head_dims = "
                f"{capabilities.head_dims}), so the production shape {shape_id} ({shape.model}) does not apply"
            )
        dtype = self._declared_float_dtypes()[0]
        runner = self._shape_runner(shape, dtype)
        layers, left_out = self._shape_layers(runner, shape)
        label = f"production shape {shape_id} ({shape.model}; {dtype_name(dtype)}"
        label += f"; left out, not declared: {', '.join(left_out)})" if left_out else ")"
        requests = self._shape_contexts(runner, shape)
        # No diagnosis of the usual mistakes here: they show at the small cases' shapes too, where the kit names
        # them; recomputing each of them over batches this size would take longer than the case itself.
        self._fused_qkv, self._diagnose = True, False
        self._query_scale = shape.query_scale if any(layer.logit_cap for layer in layers) else 1.0
        self._shape_batches(runner, shape, requests, layers, label)

    def _shape_runner(self, shape: ProductionShape, dtype: torch.dtype) -> ModelRunner:
        """A runner sized for ``shape``: room for its contexts, its three batches and a page of copy-on-write per
        request; with ``high_slots`` a cache past :data:`HIGH_SLOT` whose first slots the case burns."""
        page = self._page_size()
        longest = max(c + e for c, e in zip(shape.contexts, shape.extend, strict=True))
        growth = sum(shape.extend) + len(shape.contexts) * (2 + len(SPECULATIVE_TREES[_VERIFY_TREE]) + 2 * page)
        slots = sum(shape.contexts) + growth + (HIGH_SLOT if shape.high_slots else 0)
        return self._runner(
            dtype=dtype,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            num_layers=shape.num_layers,
            max_requests=len(shape.contexts),
            max_context_len=longest + 1 + len(SPECULATIVE_TREES[_VERIFY_TREE]) + page,
            num_slots=-(-slots // page) * page,
            table_dtype=getattr(torch, shape.table_dtype),
            fused_kv=shape.fused_kv,
        )

    def _shape_layers(self, runner: ModelRunner, shape: ProductionShape) -> tuple[list[AttentionLayer], list[str]]:
        """The runner's layers with the shape's variants the backend declares, and the flags of those left out."""
        capabilities = self._capabilities()
        layers, left_out = [], []
        for layer in runner.layers:
            variant = dict(shape.variants[min(layer.layer_id, len(shape.variants) - 1)]) if shape.variants else {}
            for field in list(variant):
                if not getattr(capabilities, _FLAGS[field]):
                    left_out.append(_FLAGS[field])
                    del variant[field]
            layers.append(dataclasses.replace(layer, **variant))  # type: ignore[arg-type]
        return layers, list(dict.fromkeys(left_out))

    def _shape_contexts(self, runner: ModelRunner, shape: ProductionShape) -> list[int]:
        """One request row per context, its cached tokens' K/V written by the kit: every third request's pages in
        descending order, the others in ascending runs; with ``high_slots``, after burning the slots below
        :data:`HIGH_SLOT` but 2,048, so the contexts straddle it."""
        pool = runner.kv_pool
        if shape.high_slots:
            pool.alloc_slots(HIGH_SLOT - 2048)
        requests, written = [], []
        for i, context in enumerate(shape.contexts):
            request = runner.new_request()
            requests.append(request)
            if context == 0:
                continue
            if i % 3 == 2:
                slots = pool.page_slots(pool.alloc_pages(-(-context // pool.page_size)).flip(0))[:context]
            else:
                slots = pool.alloc_slots(context)
            pool.req_to_token[request, :context] = slots
            written.append(slots)
        every = torch.cat(written)
        for layer in runner.layers:
            width = (every.numel(), layer.num_kv_heads, layer.head_dim)
            pool.set_kv(
                layer.layer_id, every, self._randn(*width, dtype=pool.dtype), self._randn(*width, dtype=pool.dtype)
            )
        return requests

    def _shape_batches(
        self,
        runner: ModelRunner,
        shape: ProductionShape,
        requests: list[int],
        layers: list[AttentionLayer],
        label: str,
    ) -> None:
        extend: list[Request] = [
            (request, context, new)
            for request, context, new in zip(requests, shape.contexts, shape.extend, strict=True)
            if new
        ]
        what = f"{label}: extend of {len(extend)} requests"
        self._forward(runner, ForwardMode.EXTEND, extend, what, layers=layers)
        lengths = [context + new for context, new in zip(shape.contexts, shape.extend, strict=True)]
        decode = [(request, length, 1) for request, length in zip(requests, lengths, strict=True)]
        what = f"{label}: decode of {len(decode)} requests"
        self._forward(runner, ForwardMode.DECODE, decode, what, layers=layers)
        verify_rows = requests[1::2]
        if self._capabilities().tree_mask:
            parents = SPECULATIVE_TREES[_VERIFY_TREE]
            verify = [(request, lengths[requests.index(request)] + 1, len(parents)) for request in verify_rows]
            mask = tree_mask(*[parents] * len(verify))
            what = f"{label}: target-verify of {len(verify)} requests, trees {_VERIFY_TREE}"
        else:
            verify = [(request, lengths[requests.index(request)] + 1, _CHAIN) for request in verify_rows]
            mask = None
            what = f"{label}: target-verify of {len(verify)} requests, chains of {_CHAIN}"
        self._forward(runner, ForwardMode.TARGET_VERIFY, verify, what, tree_mask=mask, layers=layers)
