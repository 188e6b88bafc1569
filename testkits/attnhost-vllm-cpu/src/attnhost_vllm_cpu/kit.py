"""Batches as vLLM's scheduler hands them to a backend: vLLM's own KV-cache allocation and metadata classes.

Shared by the engine suite (``pytest --attnhost-engine vllm``) and attnhost's
own ``tests/vllm``, so there is one copy of the batch builders.

The KV cache comes from vLLM's ``allocate_kv_cache`` (one backing buffer,
per-layer ``[blocks, kv_heads, block_size, 2 * head_size]`` views in the
requested physical layout). The test writes the cached prefix through that
*logical* view, by (block, head, offset), and reads new tokens back the
same way, so it does not share the adapter's flat-view arithmetic. The
reference attention never touches the cache at all: it runs in float64 on
each request's whole K/V sequence.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.worker.utils import allocate_kv_cache

BATCHES_DECODE = [(5, 1), (17, 1), (1, 1), (40, 1)]

PAD_SLOT = -1
"""vLLM's slot id for padded token rows."""


def allocate(
    spec: FullAttentionSpec, layer_names: list[str], num_blocks: int, layout: KVCacheLayout = KVCacheLayout.LBNHC
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


__all__ = ["BATCHES_DECODE", "PAD_SLOT", "Case", "Request", "allocate", "layer_caches", "make_case"]


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

    @property
    def seq(self) -> int:
        return self.prefix + self.query

    def written(self, position: int) -> bool:
        """Whether the new token at ``position`` has a slot (not a rejected one)."""
        return position < self.seq - self.rejected


@dataclass
class Case:
    """A batch with its prefixes in vLLM's cache, vLLM's metadata for it, and the float64 reference."""

    spec: FullAttentionSpec
    num_heads: int
    requests: list[Request]
    caches: list[torch.Tensor]
    metadata: CommonAttentionMetadata
    padding: int

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
        k = torch.cat([r.k[layer][r.prefix :] for r in self.requests])
        v = torch.cat([r.v[layer][r.prefix :] for r in self.requests])

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.randn((self.padding, *x.shape[1:]), dtype=x.dtype) * 100]).to(dtype)

        return padded(q), padded(k), padded(v)

    def reference(self, layer: int) -> torch.Tensor:
        """float64 causal attention over each request's whole sequence (GQA by repeating KV heads)."""
        group = self.num_heads // self.spec.num_kv_heads
        scale = 1.0 / math.sqrt(self.spec.head_size)
        outs = []
        for r in self.requests:
            keys = r.k[layer].repeat_interleave(group, dim=1)
            values = r.v[layer].repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", r.q[layer], keys) * scale
            allowed = torch.arange(r.seq)[None, :] <= (r.prefix + torch.arange(r.query))[:, None]
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hts,shd->thd", weights, values))
        return torch.cat(outs)

    def cached(self, layer: int, request: Request, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one token read back from vLLM's cache through its logical [B, H, N, 2D] view."""
        block, offset = self.slot(request, position)
        entry = self.caches[layer][block, :, offset]
        d = self.spec.head_size
        return entry[:, :d], entry[:, d:]


def layer_caches(
    spec: FullAttentionSpec,
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
    for cache in caches:
        cache.normal_(generator=gen)  # stale data everywhere a request does not own
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
) -> Case:
    """A batch of ``(prefix_len, query_len)`` requests with their prefixes already in vLLM's cache; ``rejected``:
    per request, how many of its last new tokens vLLM's drafter marked rejected (slot ``-1``)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
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
    case = Case(spec, num_heads, reqs, caches, _metadata(reqs, block_size, padding), padding)
    for layer, cache in enumerate(caches):
        for r in reqs:
            for p in range(r.prefix):
                block, offset = case.slot(r, p)
                cache[block, :, offset, :head_size] = r.k[layer][p].to(dtype)
                cache[block, :, offset, head_size:] = r.v[layer][p].to(dtype)
    # the inputs are rounded to the cache dtype; the reference sees exactly what the backend sees
    for r in reqs:
        for tensors in (r.k, r.v, r.q):
            tensors[:] = [t.to(dtype).to(torch.float64) for t in tensors]
    return case


class Placed(Protocol):
    """A request as the metadata needs it: its lengths and its blocks (the dense and the MLA cases' requests)."""

    prefix: int
    query: int
    blocks: list[int]

    @property
    def seq(self) -> int: ...

    def written(self, position: int) -> bool: ...


def _metadata(reqs: Sequence[Placed], block_size: int, padding: int) -> CommonAttentionMetadata:
    """vLLM's CommonAttentionMetadata for the batch: int32 lengths and block table, int64 slot mapping."""
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + r.query)
    width = max(len(r.blocks) for r in reqs) + 2
    table = torch.zeros((len(reqs) + 2, width), dtype=torch.int32)  # rows past num_reqs: other requests' rows
    table[len(reqs) :] = 7
    for i, r in enumerate(reqs):
        table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
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
    )
