"""MLA batches through vLLM's own ``MLAAttention`` layer, on vLLM's MLA cache, against decompressed float64 attention.

The case: vLLM's ``MLAAttentionSpec`` cache from ``allocate_kv_cache`` (per layer, logically ``[blocks, 1,
block_size, kv_lora_rank + qk_rope_head_dim]``) and ``CommonAttentionMetadata`` as :mod:`.kit` builds it; per
request and layer, in float64, the whole sequence's latent rows (``c_kv`` then ``k_pe``) and the new tokens'
queries ``[new, heads, qk_nope + qk_rope]``; per layer a ``kv_b_proj`` weight. The cached prefix is written
through the cache's logical view, as :mod:`.kit` does.

The forward is a model's: ``MLAAttention`` layers built as DeepSeek builds them (``attn_backend`` the class
under test, ``kv_b_proj`` a real ``ColumnParallelLinear`` in a one-rank gloo group, then each one's
``process_weights_after_loading`` in vLLM's loader's order), bound to the cache with ``bind_kv_cache`` and called inside
``set_forward_context`` with the builder's metadata. vLLM's layer writes the latent rows
(``do_kv_cache_update``), splits the batch, absorbs ``W_UK`` into the decode queries, calls ``forward_mqa`` and
``forward_mha`` and up-projects with ``W_UV``.

The reference never absorbs anything: keys ``[W_UK c ; k_pe]`` and values ``W_UV c`` decompressed per head over
each request's whole sequence, then causal attention in float64 (attnhost's
:func:`~attnhost.testing.reference.reference_request_attention`), so the split, the absorption, the latent
cache's layout and both forms are checked at once. Every new token's latent row is read back through the
logical view, and every other cache entry must be unchanged.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.kv_cache_interface import KVCacheLayout, MLAAttentionSpec

from attnhost.mla import MLAConfig
from attnhost.testing.reference import reference_request_attention
from attnhost_vllm_cpu.forward import ATOL
from attnhost_vllm_cpu.kit import _metadata, layer_caches

__all__ = [
    "MLA_ATOL",
    "MLA_BATCHES",
    "MLA_SHAPE",
    "MLACase",
    "MLARequest",
    "make_mla_case",
    "mla_check",
    "mla_forward",
    "mla_problem",
    "one_rank_group",
    "process_attention_weights",
]

MLA_BATCHES: dict[str, list[tuple[int, int]]] = {
    "prefill": [(0, 7), (0, 1), (0, 12)],
    "decode": [(5, 1), (17, 1), (1, 1), (40, 1)],
    "mixed": [(9, 1), (21, 1), (0, 6), (0, 12)],
    "mixed_with_prefix": [(9, 1), (0, 6), (21, 1), (13, 5)],
    "prefix_cached": [(16, 4), (8, 9), (33, 2)],
}
"""``(cached prefix, new tokens)`` per request. ``prefill`` takes the MHA form only, ``decode`` and
``prefix_cached`` the absorbed form only; ``mixed`` (decodes first, as vLLM's runner orders a batch) both;
``mixed_with_prefix`` has a prefill over a cached prefix, so the whole batch is absorbed."""
MLA_SHAPE = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)
"""A small latent (DeepSeek's shape, scaled down): ``v_head_dim`` differs from every QK width."""
MLA_ATOL = ATOL
"""Tolerance against the float64 reference (absolute, and as much again relative to it): the dense matrix's, which
holds although the layer rounds its absorbed queries and latent outputs to the model dtype between matmuls."""


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """vLLM's tensor-parallel group of one rank (gloo on the CPU), which vLLM's linear layers need; an existing
    group is used as it is, one made here is torn down afterwards."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{Path(tmp) / 'rendezvous'}",
        )
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@dataclass
class MLARequest:
    """One request: its cached prefix, its new tokens, its blocks, and its latent rows and queries in float64."""

    prefix: int
    query: int
    blocks: list[int]
    latent: list[torch.Tensor]  # per layer, [seq_len, kv_lora_rank + qk_rope_head_dim]: the whole sequence
    q: list[torch.Tensor]  # per layer, [query, heads, qk_nope_head_dim + qk_rope_head_dim]

    @property
    def seq(self) -> int:
        return self.prefix + self.query

    def written(self, position: int) -> bool:
        """Every new token of an MLA case has a slot (no drafter-rejected tokens here)."""
        return True


@dataclass
class MLACase:
    """An MLA batch with its prefixes in vLLM's latent cache, vLLM's metadata for it, and what the reference needs."""

    spec: MLAAttentionSpec
    mla: MLAConfig
    num_heads: int
    requests: list[MLARequest]
    caches: list[torch.Tensor]
    metadata: Any  # vLLM's CommonAttentionMetadata
    padding: int
    weights: list[torch.Tensor]  # per layer, kv_b_proj's [heads * (qk_nope + v_head_dim), kv_lora_rank], float64

    @property
    def block_size(self) -> int:
        return int(self.spec.block_size)

    @property
    def num_tokens(self) -> int:
        return sum(r.query for r in self.requests)

    @property
    def scale(self) -> float:
        return self.mla.default_scaling

    def slot(self, request: MLARequest, position: int) -> tuple[int, int]:
        """(block, offset) of a request's token ``position`` in vLLM's cache."""
        return request.blocks[position // self.block_size], position % self.block_size

    def layer_inputs(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[T, heads, qk_head_dim]``, ``kv_c_normed`` ``[T, kv_lora_rank]`` and ``k_pe`` ``[T, 1, rope]`` as
        DeepSeek passes them to ``MLAAttention``, with ``padding`` garbage rows at the end."""
        rank = self.mla.kv_lora_rank
        q = torch.cat([r.q[layer] for r in self.requests])
        latent = torch.cat([r.latent[layer][r.prefix :] for r in self.requests])

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.randn((self.padding, *x.shape[1:]), dtype=x.dtype) * 100]).to(dtype)

        return padded(q), padded(latent[:, :rank]), padded(latent[:, rank:].unsqueeze(1))

    def decompressed(self, layer: int, request: MLARequest) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys ``[seq, heads, qk_head_dim]`` and values ``[seq, heads, v_head_dim]``, per head."""
        mla, heads = self.mla, self.num_heads
        rank, nope = mla.kv_lora_rank, mla.qk_nope_head_dim
        latent = request.latent[layer]
        kv = (latent[:, :rank] @ self.weights[layer].T).view(-1, heads, nope + mla.v_head_dim)
        rope = latent[:, rank:].unsqueeze(1).expand(-1, heads, -1)
        return torch.cat([kv[..., :nope], rope], -1), kv[..., nope:]

    def reference(self, layer: int) -> torch.Tensor:
        """``[T, heads, v_head_dim]`` float64: causal attention over each request's decompressed sequence."""
        outs = []
        for r in self.requests:
            k, v = self.decompressed(layer, r)
            outs.append(reference_request_attention(r.q[layer], k, v, prefix_len=r.prefix, scaling=self.scale))
        return torch.cat(outs)

    def cached(self, layer: int, request: MLARequest, position: int) -> torch.Tensor:
        """One token's latent row read back through vLLM's logical ``[blocks, 1, block_size, width]`` view."""
        block, offset = self.slot(request, position)
        return self.caches[layer][block, 0, offset]


def make_mla_case(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    mla: MLAConfig = MLA_SHAPE,
    num_heads: int = 8,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    layout: KVCacheLayout = KVCacheLayout.LBNHC,
    shuffle_blocks: bool = True,
    padding: int = 3,
    seed: int = 0,
) -> MLACase:
    """A batch of ``(prefix_len, query_len)`` requests with their prefixes' latent rows already in vLLM's cache."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    width = mla.latent_dim
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=width, dtype=dtype)
    free, caches = layer_caches(spec, requests, num_layers, layout, rng if shuffle_blocks else None, gen)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)

    heads, qk = num_heads, mla.qk_head_dim
    weights = [randn(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank) for _ in range(num_layers)]
    for w in weights:  # unit-sized keys and values: the rounded weight is exactly what the layer holds
        w.copy_((w / mla.kv_lora_rank**0.5).to(dtype).to(torch.float64))
    reqs = []
    for prefix, query in requests:
        seq = prefix + query
        blocks = [free.pop() for _ in range(-(-seq // block_size))]
        reqs.append(
            MLARequest(
                prefix,
                query,
                blocks,
                latent=[randn(seq, width) for _ in range(num_layers)],
                q=[randn(query, heads, qk) for _ in range(num_layers)],
            )
        )
    case = MLACase(spec, mla, heads, reqs, caches, _metadata(reqs, block_size, padding), padding, weights)
    for layer, cache in enumerate(caches):
        for r in reqs:
            for p in range(r.prefix):
                block, offset = case.slot(r, p)
                cache[block, 0, offset] = r.latent[layer][p].to(dtype)
    return case


def process_attention_weights(layer: Any, dtype: torch.dtype) -> None:
    """``layer.process_weights_after_loading`` as the installed vLLM's loader calls it: with the model dtype where
    the method takes one (vLLM 0.33: ``(act_dtype)``), else without (0.34 reads the ``act_dtype`` the layer took
    from torch's default dtype when it was built, which is why :func:`mla_forward` builds layers under it)."""
    parameters = inspect.signature(layer.process_weights_after_loading).parameters
    if parameters:
        layer.process_weights_after_loading(dtype)
    else:
        layer.process_weights_after_loading()


def mla_forward(cls: type, case: MLACase, dtype: torch.dtype, what: str) -> tuple[list[torch.Tensor], Any]:
    """Build ``MLAAttention`` layers on ``cls`` and the metadata with ``cls``'s builder, run every layer as a model
    does; vLLM's output per layer (``[T + padding, heads * v_head_dim]``) and the metadata. Call inside
    :func:`one_rank_group`. An exception becomes an ``AssertionError`` naming the step (the cause chained)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    mla, heads = case.mla, case.num_heads
    config = VllmConfig()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(case.caches))]
    layers = []
    try:
        # vLLM's loader builds the model and processes its weights with the model dtype as torch's default
        with set_current_vllm_config(config), set_default_torch_dtype(dtype), torch.no_grad():
            for name, weight, cache in zip(names, case.weights, case.caches, strict=True):
                kv_b_proj = ColumnParallelLinear(
                    mla.kv_lora_rank,
                    heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                    bias=False,
                    params_dtype=dtype,
                    prefix=name.replace(".attn", ".kv_b_proj"),
                )
                kv_b_proj.weight.copy_(weight.to(dtype))
                layer = MLAAttention(
                    num_heads=heads,
                    scale=case.scale,
                    qk_nope_head_dim=mla.qk_nope_head_dim,
                    qk_rope_head_dim=mla.qk_rope_head_dim,
                    v_head_dim=mla.v_head_dim,
                    q_lora_rank=None,
                    kv_lora_rank=mla.kv_lora_rank,
                    kv_b_proj=kv_b_proj,
                    prefix=name,
                    attn_backend=cls,
                )
                kv_b_proj.quant_method.process_weights_after_loading(kv_b_proj)  # vLLM's loader: modules first,
                process_attention_weights(layer, dtype)  # then attention layers (W_UK_T, W_UV)
                layer.bind_kv_cache(cache)
                layers.append(layer)
    except Exception as exc:
        raise AssertionError(f"{what}: building vLLM's MLAAttention layers raised {type(exc).__name__}: {exc}") from exc
    try:
        metadata = cls.get_builder_cls()(case.spec, names, config, "cpu").build(0, case.metadata)  # type: ignore[attr-defined]
    except Exception as exc:
        raise AssertionError(f"{what}: the metadata builder raised {type(exc).__name__}: {exc}") from exc
    outputs = []
    slots = case.metadata.slot_mapping
    with set_forward_context(dict.fromkeys(names, metadata), config, slot_mapping=dict.fromkeys(names, slots)):
        for i, layer in enumerate(layers):
            q, kv_c, k_pe = case.layer_inputs(i, dtype)
            try:
                with torch.no_grad():
                    outputs.append(layer(q, kv_c, k_pe, output_shape=(q.shape[0], heads * mla.v_head_dim)))
            except Exception as exc:
                raise AssertionError(f"{what}: MLAAttention layer {i} raised {type(exc).__name__}: {exc}") from exc
    return outputs, metadata


def mla_problem(case: MLACase, outputs: list[torch.Tensor], before: list[torch.Tensor], atol: float) -> str | None:
    """What is wrong with the outputs and the caches (``before``: the caches' contents before the forward)."""
    n, heads, v_dim = case.num_tokens, case.num_heads, case.mla.v_head_dim
    starts = [0]
    for r in case.requests:
        starts.append(starts[-1] + r.query)
    for layer, output in enumerate(outputs):
        got = output[:n].double().view(n, heads, v_dim)
        ref = case.reference(layer)
        if not bool(torch.isfinite(got).all()):
            token = int((~torch.isfinite(got)).flatten().nonzero()[0]) // (heads * v_dim)
            return f"output not finite (or never written) at {_where(case, starts, token, layer)}"
        excess = (got - ref).abs() - atol * ref.abs()
        if float(excess.max()) > atol:
            flat = int(excess.flatten().argmax())
            token, rest = divmod(flat, heads * v_dim)
            error = float((got - ref).abs().flatten()[flat])
            return (
                f"max abs error {error:.1e} exceeds {atol:.0e} (+{atol:.0e}*|ref|) "
                f"({_where(case, starts, token, layer)}, head {rest // v_dim})"
            )
    for layer, cache in enumerate(case.caches):
        written = torch.zeros(cache.shape[0], cache.shape[2], dtype=torch.bool)  # [block, offset]
        for i, r in enumerate(case.requests):
            for p in range(r.prefix, r.seq):
                block, offset = case.slot(r, p)
                written[block, offset] = True
                diff = float((case.cached(layer, r, p).double() - r.latent[layer][p]).abs().max())
                if diff != 0:
                    return (
                        f"MLA cache, layer {layer}: block {block} offset {offset} (slot_mapping of request {i}, token "
                        f"{p - r.prefix} of {r.query}) does not hold that token's latent row, c_kv then k_pe (max abs "
                        f"diff {diff:.1e}); write it where slot_mapping says, into this layer's cache"
                    )
        changed = (cache != before[layer]).any(dim=3).any(dim=1) & ~written  # logical [block, 1, offset, width]
        if bool(changed.any()):
            block, offset = (int(x) for x in changed.nonzero()[0])
            return (
                f"MLA cache, layer {layer}: block {block} offset {offset} changed, but no new token's slot is there "
                "(slot_mapping pads rows with -1: skip them; write only the new tokens' slots)"
            )
    return None


def _where(case: MLACase, starts: list[int], token: int, layer: int) -> str:
    request = bisect.bisect_right(starts, token) - 1
    return f"layer {layer}, request {request}, token {token - starts[request]} of {case.requests[request].query}"


def mla_check(cls: type, batch: str, block_size: int, dtype: torch.dtype, what: str) -> None:
    """Run one ``MLA_BATCHES`` batch through ``cls``; raise ``AssertionError`` with one line naming what broke."""
    case = make_mla_case(MLA_BATCHES[batch], block_size=block_size, dtype=dtype)
    before = [cache.clone() for cache in case.caches]
    with one_rank_group():
        outputs, _ = mla_forward(cls, case, dtype, what)
    found = mla_problem(case, outputs, before, MLA_ATOL[dtype])
    if found is not None:
        raise AssertionError(f"{what}: {found}")
