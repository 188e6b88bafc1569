"""Batches as vLLM's scheduler hands them to a backend: vLLM's own KV-cache allocation and metadata classes.

Shared by the engine suite (``pytest --attnhost-engine vllm``) and attnhost's
own ``tests/vllm``, so there is one copy of the batch builders.

The KV cache comes from vLLM's ``allocate_kv_cache`` (one backing buffer,
per-layer ``[blocks, kv_heads, block_size, 2 * head_size]`` views in the
requested physical layout). The test writes the cached prefix through that
*logical* view, by (block, head, offset), and reads new tokens back the
same way, so it does not share the adapter's flat-view arithmetic. The
reference attention never touches the cache at all: it is attnhost's float64
reference (:func:`attnhost.testing.reference.reference_request_attention`)
on each request's whole K/V sequence, with the layer's variant.

A case may carry an attention variant as vLLM asks for it (:class:`Variant`):
a sliding window makes the group vLLM's ``SlidingWindowSpec`` and, as vLLM's
sliding-window manager does, points the block-table entries wholly before a
request's window at the null block (block 0, stale data): a backend that
reads a key outside the window reads garbage. Sinks are one logit per query
head and layer, one of them ``-inf`` (vLLM's value for a sink never loaded);
a non-causal case is vLLM's ``causal=False`` batch over a ``non_causal``
full-attention group (DFlash drafts).

A case may have an FP8 cache (``kv_cache_dtype`` ``fp8`` / ``fp8_e4m3`` /
``fp8_e5m2``): vLLM's ``uint8`` allocation with per-layer scales that put the
format's largest value at 2 (``k_scale`` doubled in layer 1), so that the
tail of the inputs saturates. The prefix is stored as the contract's
quantising write (:func:`attnhost.quantize_fp8`) and the
reference reads every key and value as the cache holds it, dequantised
(``stored * scale``): quantisation changes what the cache holds, not how
exactly a backend must attend over it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    KVQuantMode,
    SlidingWindowSpec,
    compute_layout_strides,
)
from vllm.v1.worker.utils import allocate_kv_cache

from attnhost.dtypes import quantize_fp8
from attnhost.testing.reference import reference_request_attention

FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""vLLM's ``--kv-cache-dtype`` names of FP8 caches and the float8 dtype each stores."""

BATCHES_DECODE = [(5, 1), (17, 1), (1, 1), (40, 1)]

PAD_SLOT = -1
"""vLLM's slot id for padded token rows."""


def allocate(
    spec: AttentionSpec, layer_names: list[str], num_blocks: int, layout: KVCacheLayout = KVCacheLayout.LBNHC
) -> dict[str, torch.Tensor]:
    """vLLM's own KV-cache allocation for one group of layers."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(layer_names), layout)
    tensor = KVCacheTensor(
        size=len(layer_names) * num_blocks * spec.page_size_bytes,
        layers=layer_names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)]
    )
    caches: dict[str, torch.Tensor] = allocate_kv_cache(config, torch.device("cpu"), layout)
    return caches


__all__ = [
    "BATCHES_DECODE",
    "FP8_FORMATS",
    "PAD_SLOT",
    "PLAIN",
    "Case",
    "Request",
    "Variant",
    "allocate",
    "fp8_scales",
    "layer_caches",
    "make_case",
]

NULL_BLOCK = 0
"""vLLM's null block: where its sliding-window manager points the block-table entries it freed."""


@dataclass(frozen=True)
class Variant:
    """A layer's attention variant as vLLM's ``Attention`` layer hands it to the impl, and the batch's causality."""

    sliding_window: int | None = None
    """vLLM's (HF's) window ``W``: a query sees ``W`` keys, itself included (attnhost's ``sliding_window_size``
    is ``W - 1``)."""
    logits_soft_cap: float | None = None
    sinks: bool = False
    causal: bool = True

    @property
    def features(self) -> tuple[str, ...]:
        """The ``BackendCapabilities`` flags a backend must declare to run it."""
        needs = (
            ("sliding_window", self.sliding_window is not None),
            ("logit_cap", bool(self.logits_soft_cap)),
            ("sinks", self.sinks),
            ("non_causal", not self.causal),
        )
        return tuple(flag for flag, needed in needs if needed)

    def describe(self) -> str:
        parts = [
            *([f"sliding_window={self.sliding_window}"] if self.sliding_window is not None else []),
            *([f"logits_soft_cap={self.logits_soft_cap:g}"] if self.logits_soft_cap else []),
            *(["sinks"] if self.sinks else []),
            *(["causal=False"] if not self.causal else []),
        ]
        return ", ".join(parts) or "plain causal"


PLAIN = Variant()


@dataclass
class Request:
    """One request of a batch: its cached prefix, its new tokens, its blocks and its whole K/V/Q in float64."""

    prefix: int
    query: int
    blocks: list[int]
    k: list[torch.Tensor]  # per layer, [seq_len, kv_heads, head] float64: the whole sequence
    v: list[torch.Tensor]
    q: list[torch.Tensor]  # per layer, [query, heads, head] float64
    rejected: int = 0
    """Its last ``rejected`` new tokens carry slot ``-1``, as vLLM's drafter marks rejected tokens: never written,
    their outputs discarded."""
    k_in: list[torch.Tensor] | None = None
    """With an FP8 cache, per layer the whole sequence's K before quantisation (the layer gets its new rows; ``k``
    then holds what the cache holds, dequantised); ``None``: ``k`` is both."""
    v_in: list[torch.Tensor] | None = None

    @property
    def seq(self) -> int:
        return self.prefix + self.query

    def written(self, position: int) -> bool:
        """Whether the new token at ``position`` has a slot (not a rejected one)."""
        return position < self.seq - self.rejected


@dataclass
class Case:
    """A batch with its prefixes in vLLM's cache, vLLM's metadata for it, and the float64 reference."""

    spec: AttentionSpec
    num_heads: int
    requests: list[Request]
    caches: list[torch.Tensor]
    metadata: CommonAttentionMetadata
    padding: int
    variant: Variant = PLAIN
    sinks: list[torch.Tensor] | None = None
    """Per layer, the ``[num_heads]`` sink logits (float64, rounded to the case's dtype) when the variant has sinks."""
    kv_cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype``: ``auto`` (the model's dtype) or a key of :data:`FP8_FORMATS`."""
    scales: list[tuple[float, float]] | None = None
    """Per layer, vLLM's ``(_k_scale, _v_scale)`` of an FP8 cache."""

    @property
    def fp8(self) -> torch.dtype | None:
        return FP8_FORMATS.get(self.kv_cache_dtype)

    @property
    def block_size(self) -> int:
        return int(self.spec.block_size)

    @property
    def num_tokens(self) -> int:
        return sum(r.query for r in self.requests)

    def slot(self, request: Request, position: int) -> tuple[int, int]:
        """(block, offset) of a request's token ``position`` in vLLM's cache."""
        return request.blocks[position // self.block_size], position % self.block_size

    def layer_inputs(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the new tokens as vLLM passes them, with ``padding`` garbage rows at the end."""
        q = torch.cat([r.q[layer] for r in self.requests])
        k = torch.cat([(r.k if r.k_in is None else r.k_in)[layer][r.prefix :] for r in self.requests])
        v = torch.cat([(r.v if r.v_in is None else r.v_in)[layer][r.prefix :] for r in self.requests])

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.randn((self.padding, *x.shape[1:]), dtype=x.dtype) * 100]).to(dtype)

        return padded(q), padded(k), padded(v)

    def reference(self, layer: int) -> torch.Tensor:
        """attnhost's float64 reference over each request's whole sequence, with the case's variant."""
        variant = self.variant
        window = -1 if variant.sliding_window is None else variant.sliding_window - 1
        sinks = None if self.sinks is None else self.sinks[layer]
        outs = []
        for r in self.requests:
            out = reference_request_attention(
                r.q[layer],
                r.k[layer],
                r.v[layer],
                prefix_len=r.prefix,
                scaling=self.spec.head_size**-0.5,
                sliding_window_size=window,
                logit_cap=variant.logits_soft_cap or 0.0,
                sinks=sinks,
                causal=variant.causal,
            )
            outs.append(out)
        return torch.cat(outs)

    def cached(self, layer: int, request: Request, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one token read back from vLLM's cache through its logical [B, H, N, 2D] view."""
        block, offset = self.slot(request, position)
        entry = self.caches[layer][block, :, offset]
        d = self.spec.head_size
        fp8 = self.fp8
        if fp8 is None or self.scales is None:
            return entry[:, :d], entry[:, d:]
        k_scale, v_scale = self.scales[layer]
        values = entry.view(fp8).double()
        return values[:, :d] * k_scale, values[:, d:] * v_scale


def fp8_scales(fp8: torch.dtype, num_layers: int) -> list[tuple[float, float]]:
    """Per layer ``(k_scale, v_scale)`` that put the format's largest value at 2 (``k_scale`` doubled in layer 1), so
    that normal inputs saturate in their tails: the write must divide by the scale and clamp, the read multiply."""
    base = 2.0 / torch.finfo(fp8).max
    return [(base * (2.0 if layer == 1 else 1.0), base) for layer in range(num_layers)]


def layer_caches(
    spec: AttentionSpec,
    requests: Sequence[tuple[int, int]],
    num_layers: int,
    layout: KVCacheLayout,
    shuffle: random.Random | None,
    gen: torch.Generator,
) -> tuple[list[int], list[torch.Tensor]]:
    """The free blocks for ``requests`` (block 0 is vLLM's null block; shuffled as a long-running server's are, when
    ``shuffle`` is given) and one cache per layer from vLLM's own allocation, filled with stale data everywhere."""
    num_blocks = sum(-(-(p + q) // spec.block_size) for p, q in requests) + 3
    free = list(range(1, num_blocks))
    if shuffle is not None:
        shuffle.shuffle(free)
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    by_name = allocate(spec, layer_names, num_blocks, layout)
    caches = [by_name[name] for name in layer_names]
    for cache in caches:  # stale data everywhere a request does not own (finite bytes in an FP8 cache's uint8)
        if cache.dtype == torch.uint8:
            stale = torch.randn(cache.shape, generator=gen).to(torch.float8_e5m2).view(torch.uint8)
            cache.copy_(stale)
        else:
            cache.normal_(generator=gen)
    return free, caches


def make_case(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int = 32,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    layout: KVCacheLayout = KVCacheLayout.LBNHC,
    shuffle_blocks: bool = True,
    padding: int = 3,
    seed: int = 0,
    rejected: list[int] | None = None,
    variant: Variant = PLAIN,
    kv_cache_dtype: str = "auto",
) -> Case:
    """A batch of ``(prefix_len, query_len)`` requests with their prefixes already in vLLM's cache; ``rejected``:
    per request, how many of its last new tokens vLLM's drafter marked rejected (slot ``-1``); ``variant``: the
    layers' attention variant and the batch's causality; ``kv_cache_dtype``: ``auto`` or an FP8 format of
    :data:`FP8_FORMATS` (full attention only)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec: AttentionSpec
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    if fp8 is not None:  # vLLM's FP8 cache: uint8 entries, per-tensor scales
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
            non_causal=not variant.causal,
        )
    elif variant.sliding_window is not None:
        spec = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=variant.sliding_window,
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            non_causal=not variant.causal,
        )
    free, caches = layer_caches(spec, requests, num_layers, layout, rng if shuffle_blocks else None, gen)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    reqs = []
    for (prefix, query), dropped in zip(requests, rejected or [0] * len(requests), strict=True):
        seq = prefix + query
        blocks = [free.pop() for _ in range(-(-seq // block_size))]
        reqs.append(
            Request(
                prefix,
                query,
                blocks,
                k=[randn(seq, num_kv_heads, head_size) for _ in range(num_layers)],
                v=[randn(seq, num_kv_heads, head_size) for _ in range(num_layers)],
                q=[randn(query, num_heads, head_size) for _ in range(num_layers)],
                rejected=dropped,
            )
        )
    retained = None if variant.sliding_window is None else variant.sliding_window - 1
    metadata = _metadata(reqs, block_size, padding, retained=retained, causal=variant.causal)
    sinks = None
    if variant.sinks:  # a spread of about N(0, 2^2), as trained sinks have, and one -inf (a sink never loaded)
        sinks = [(randn(num_heads) * 2).to(dtype).to(torch.float64) for _ in range(num_layers)]
        sinks[0][0] = float("-inf")
    scales = None if fp8 is None else fp8_scales(fp8, num_layers)
    case = Case(spec, num_heads, reqs, caches, metadata, padding, variant, sinks, kv_cache_dtype, scales)
    # the inputs are rounded to the model's dtype; the reference sees exactly what the backend sees
    for r in reqs:
        for tensors in (r.k, r.v, r.q):
            tensors[:] = [t.to(dtype).to(torch.float64) for t in tensors]
    if fp8 is not None and scales is not None:  # the layer gets the new K/V as they are; the cache holds them in FP8
        for r in reqs:
            r.k_in, r.v_in = r.k, r.v
            r.k = [_fp8_round(t, scales[i][0], fp8) for i, t in enumerate(r.k_in)]
            r.v = [_fp8_round(t, scales[i][1], fp8) for i, t in enumerate(r.v_in)]
    for layer, cache in enumerate(caches):
        for r in reqs:
            for p in range(r.prefix):
                block, offset = case.slot(r, p)
                if r.k_in is not None and r.v_in is not None and fp8 is not None and scales is not None:
                    k_scale, v_scale = scales[layer]  # the contract's write, whose bytes r.k / r.v read back
                    cache[block, :, offset, :head_size] = quantize_fp8(r.k_in[layer][p], k_scale, fp8).view(torch.uint8)
                    cache[block, :, offset, head_size:] = quantize_fp8(r.v_in[layer][p], v_scale, fp8).view(torch.uint8)
                else:
                    cache[block, :, offset, :head_size] = r.k[layer][p].to(dtype)
                    cache[block, :, offset, head_size:] = r.v[layer][p].to(dtype)
    return case


def _fp8_round(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """What an FP8 cache holds for ``x``, read back: ``quantize_fp8(x) * scale`` in float64."""
    return quantize_fp8(x, scale, fp8).to(torch.float64) * scale


class Placed(Protocol):
    """A request as the metadata needs it: its lengths and its blocks (the dense and the MLA cases' requests)."""

    prefix: int
    query: int
    blocks: list[int]

    @property
    def seq(self) -> int: ...

    def written(self, position: int) -> bool: ...


def _metadata(
    reqs: Sequence[Placed], block_size: int, padding: int, *, retained: int | None = None, causal: bool = True
) -> CommonAttentionMetadata:
    """vLLM's CommonAttentionMetadata for the batch: int32 lengths and block table, int64 slot mapping.

    ``retained``: a sliding-window group keeps this many tokens before each request's first new one (``W - 1``);
    the block-table entries wholly before them point at the null block, as vLLM's worker leaves them."""
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + r.query)
    width = max(len(r.blocks) for r in reqs) + 2
    table = torch.zeros((len(reqs) + 2, width), dtype=torch.int32)  # rows past num_reqs: other requests' rows
    table[len(reqs) :] = 7
    for i, r in enumerate(reqs):
        table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        if retained is not None:
            table[i, : max(0, r.prefix - retained) // block_size] = NULL_BLOCK
    slots = [
        r.blocks[p // block_size] * block_size + p % block_size if r.written(p) else PAD_SLOT
        for r in reqs
        for p in range(r.prefix, r.seq)
    ] + [PAD_SLOT] * padding
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor([r.seq for r in reqs], dtype=torch.int32),
        num_reqs=len(reqs),
        num_actual_tokens=starts[-1] + padding,
        max_query_len=max(r.query for r in reqs),
        max_seq_len=max(r.seq for r in reqs),
        block_table_tensor=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        causal=causal,
    )
