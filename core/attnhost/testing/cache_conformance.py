"""The conformance kit's cache-format cases: pages larger than one token, and FP8 caches with per-layer scales.

Both are properties of the cache a backend reads, so the cases that read a
cache in the ways that matter (a prefix that ends inside a page, a prefix in
pages that are not adjacent, a decode step that opens a page, an FP8 value
that saturates) run here, once per page size or format, rather than every
case of the kit once per each (docs/kv-cache.md). An FP8 output is compared
with the float64 reference over the *dequantised* cache (``stored * scale``),
so the tolerance is the query dtype's: quantisation changes what the cache
holds, not how exactly a backend must attend over it.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from attnhost.backend import FP8_KV_DTYPES, AttentionLayer, dtype_name
from attnhost.dtypes import quantize_fp8
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.runner import ModelRunner
from attnhost.testing.harness import ConformanceHarness, LayerRun, Step, fail, same_bits

__all__ = ["FP8_SCALES", "PAGE_SIZES", "CacheConformance"]

PAGE_SIZES: tuple[int, ...] = (1, 16, 64)
"""The page sizes the paged case runs at: token slots, SGLang's and vLLM's usual 16, and a page longer than
every request's prefix here."""

FP8_SCALES: dict[str, tuple[float, float, float]] = {
    "float8_e4m3fn": (1 / 224, 1 / 224, 12.0),
    "float8_e5m2": (1 / 28672, 1 / 28672, 12.0),
}
"""Per FP8 format: ``(k_scale, v_scale, big)``, the scales putting ``finfo.max * scale`` at 2 (layer 1 doubles
``k_scale``): dequantised values stay of the order of the float cases' (the tolerances are theirs), the tail of
a standard normal saturates, and so do the entries of magnitude ``big`` the kit writes into every batch."""


class CacheConformance(ConformanceHarness):
    """Pages and FP8 caches: every backend runs the paged case at the page sizes it declares (all of
    :data:`PAGE_SIZES` when it declares none); the FP8 cases run for the FP8 formats it declares."""

    page_sizes_to_test: ClassVar[tuple[int, ...]] = PAGE_SIZES

    def _require_page_size(self, page_size: int) -> None:
        declared = self._capabilities().page_sizes
        if declared is not None and page_size not in declared:
            pytest.skip(f"backend {self.name!r} does not declare page size {page_size} (capabilities.page_sizes)")

    def _cache_steps(self, runner: ModelRunner, label: str, layers: list[AttentionLayer] | None = None) -> None:
        """The batches that read a cache every way: prefills across page boundaries, extends whose prefix ends
        inside a page, a prefix in reversed (non-adjacent) pages, a mixed batch, and decode steps that open
        pages; each output against the reference, each layer's cache against what its writes must leave."""
        r = [runner.new_request() for _ in range(3)]
        steps: list[tuple[ForwardMode, list[tuple[int, int, int]], str]] = [
            (ForwardMode.EXTEND, [(r[0], 0, 70), (r[1], 0, 9), (r[2], 0, 1)], "prefill"),
            (ForwardMode.EXTEND, [(r[0], 70, 11), (r[1], 9, 5)], "extend with a prefix ending inside a page"),
        ]
        for mode, requests, what in steps:
            self._cache_step(runner, mode, requests, f"{label}: {what}", layers)
        scattered = self._fragmented_prefix(runner, 37)
        self._cache_step(
            runner,
            ForwardMode.MIXED,
            [(scattered, 37, 6), (r[1], 14, 3), (r[2], 1, 1)],
            f"{label}: mixed batch over a prefix in reversed pages",
            layers,
        )
        lengths = {r[0]: 81, r[1]: 17, r[2]: 2, scattered: 43}
        for step in range(2):
            batch = [(request, n + step, 1) for request, n in lengths.items()]
            self._cache_step(runner, ForwardMode.DECODE, batch, f"{label}: decode step {step}", layers)

    def _cache_step(
        self,
        runner: ModelRunner,
        mode: ForwardMode,
        requests: list[tuple[int, int, int]],
        what: str,
        layers: list[AttentionLayer] | None,
    ) -> Step:
        step = self._forward(runner, mode, requests, what, layers=layers, check=False)
        for run in step.layers:  # the write first: a wrong cache explains a wrong output, not the other way
            self._check_written(what, runner, step.batch, run)
            self._check_output(what, run, step.batch)
        return step

    def _check_written(self, what: str, runner: ModelRunner, batch: ForwardBatch, run: LayerRun) -> None:
        """The layer's cache holds exactly what the write must leave (the last layer run: later layers do not
        touch it), an FP8 one the quantising write's bytes, named by the mistake that explains a difference."""
        pool, layer = runner.kv_pool, run.layer
        for kind, buffer, new, expected, scale in (
            ("K", pool.k_buffer(layer.layer_id), run.k, run.expected_k, layer.k_scale),
            ("V", pool.v_buffer(layer.layer_id), run.v, run.expected_v, layer.v_scale),
        ):
            if same_bits(buffer, expected):
                continue
            loc = batch.out_cache_loc
            if not same_bits(buffer[loc], expected[loc]):
                got = buffer[loc]
                why = ""
                if pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    name = dtype_name(pool.dtype)
                    if same_bits(got, quantize_fp8(new, 1.0, pool.dtype)):
                        why = (
                            f"; it holds saturate({kind.lower()}) in {name}: divide by layer."
                            f"{kind.lower()}_scale before the cast (stored = saturate(x / scale))"
                        )
                    elif same_bits(got, (new.to(torch.float32) / scale).to(pool.dtype)):
                        why = (
                            f"; it holds ({kind.lower()} / {kind.lower()}_scale) cast without saturation: clamp "
                            f"to ±torch.finfo({name}).max before the cast (an {name} overflow is not the largest "
                            "value)"
                        )
                fail(
                    f"{what}: layer {layer.layer_id}'s {kind} at out_cache_loc is not what the cache's write "
                    f"leaves ({dtype_name(pool.dtype)} cache){why}; write with kv_pool.set_kv(layer.layer_id, "
                    "forward_batch.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)"
                )
            fail(f"{what}: layer {layer.layer_id}'s {kind} cache changed outside out_cache_loc")

    # -- pages --------------------------------------------------------------------------

    @pytest.mark.parametrize("page_size", PAGE_SIZES, ids=[f"page{size}" for size in PAGE_SIZES])
    def test_paged_cache(self, page_size: int) -> None:
        """The cache allocated in pages of ``page_size`` tokens (SGLang's ``--page-size``, vLLM's block size): a
        request's slots run in order within a page and jump between pages."""
        if page_size not in self.page_sizes_to_test:
            pytest.skip(f"page size {page_size} is not in page_sizes_to_test")
        self._require_page_size(page_size)
        runner = self._runner(page_size=page_size)
        self._cache_steps(runner, f"paged cache (page size {page_size})")

    # -- FP8 ----------------------------------------------------------------------------

    @pytest.mark.parametrize("fp8", FP8_KV_DTYPES)
    def test_fp8_kv_cache(self, fp8: str) -> None:
        """An FP8 cache with per-layer scales other than 1 and values that saturate, in pages of 16, for every
        declared float dtype (the first in full, the others their first batches): the cache holds the
        quantising write's bytes, the output is attention over the dequantised cache."""
        declared = self._capabilities().kv_cache_dtypes
        if declared is None or fp8 not in declared:
            pytest.skip(
                f"backend {self.name!r} does not declare the FP8 cache {fp8} "
                f"(capabilities.kv_cache_dtypes = {declared}): engines refuse that cache for it at start-up"
            )
        pages = self._capabilities().page_sizes
        page_size = 16 if pages is None or 16 in pages else pages[0]
        k_scale, v_scale, big = FP8_SCALES[fp8]
        for i, dtype in enumerate(self._declared_float_dtypes()):
            label = f"{fp8} cache, {dtype_name(dtype)} model, k_scale {k_scale:g}, v_scale {v_scale:g}"
            runner = self._runner(dtype=dtype, kv_cache_dtype=getattr(torch, fp8), page_size=page_size)
            layers = [
                AttentionLayer(
                    layer.layer_id,
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_dim,
                    layer.scaling,
                    k_scale=k_scale * (1 + layer.layer_id),
                    v_scale=v_scale,
                )
                for layer in runner.layers
            ]
            self._saturating = big
            try:
                if i == 0:
                    self._cache_steps(runner, label, layers)
                else:
                    request = runner.new_request()
                    self._cache_step(runner, ForwardMode.EXTEND, [(request, 0, 21)], f"{label}: prefill", layers)
                    self._cache_step(runner, ForwardMode.DECODE, [(request, 21, 1)], f"{label}: decode", layers)
            finally:
                self._saturating = 0.0
