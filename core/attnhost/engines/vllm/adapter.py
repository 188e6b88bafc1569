"""A vLLM attention backend (backend, metadata builder, impl) that runs an attnhost backend on vLLM's own cache.

The KV cache, without a copy. vLLM gives each layer one tensor, logically
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` with K and V side
by side on the last axis, and lets a backend choose how that is laid out in
memory (``supported_kv_cache_layouts``). The adapter asks for ``LBNHC``
(memory order ``[blocks, block_size, heads, 2 * head_size]``), in which
``cache.transpose(1, 2).view(-1, heads, 2 * head_size)`` is a zero-copy
token-major view, and its halves ``[..., :head_size]`` / ``[...,
head_size:]`` are exactly the strided ``[num_slots, kv_heads, head_dim]``
buffers attnhost's :class:`~attnhost.KVCache` contract allows. Slot ``block
* block_size + offset`` is vLLM's own ``slot_mapping`` numbering, so new
tokens are written at ``slot_mapping`` and ``req_to_token`` is
``block_table`` expanded to token level — per batch, metadata only.

Batches. One vLLM call per layer covers a mixed prefill + decode batch; it
becomes one attnhost batch (``DECODE`` when every request brings one token,
``EXTEND`` / ``MIXED`` otherwise) with ``prefix_len = seq_len - query_len``
per request, which also covers chunked prefill and prefix caching. The
output is written into vLLM's ``output`` tensor.

The builder builds the attnhost backend (one per builder, i.e. per vLLM
runner and KV-cache group, so a draft never shares the target's), the
attnhost batch and the backend's per-batch metadata; the impl, per layer,
slices the padded token rows off, calls the backend and copies the result
into ``output``.

Attention variants (sliding windows, logit soft-caps, sinks, non-causal
batches) pass through as the backend declares them
(:mod:`attnhost.engines.vllm.variants`). Everything the attnhost contract
cannot express, or the backend does not declare, is refused with one error
naming the backend and the feature — by vLLM's selector
(``supports_*``, ``validate_configuration``) when it selects the backend,
and again when a layer or batch asks for it. Never a wrong number.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend as VLLMAttentionBackend,
)
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheLayout,
    KVQuantMode,
    MLAAttentionSpec,
    RSWASpec,
    is_quantized_kv_cache,
)

from attnhost.backend import AttentionBackend, BackendCapabilities, dtype_name
from attnhost.dtypes import quantize_fp8
from attnhost.engines.runner_view import RunnerView
from attnhost.engines.vllm.graphs import UniformBatches
from attnhost.engines.vllm.identity import VLLMIdentity, identify
from attnhost.engines.vllm.names import BACKENDS_MODULE, new_layer_id
from attnhost.engines.vllm.variants import WINDOWED_NON_CAUSAL, LayerVariants, layer_variants, refuse_non_causal
from attnhost.errors import UnsupportedFeatureError
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.host import default_host

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from attnhost.engines.export import ExportedBackend

__all__ = [
    "AttnhostVLLMBackend",
    "AttnhostVLLMImpl",
    "AttnhostVLLMMetadata",
    "AttnhostVLLMMetadataBuilder",
    "UnsupportedFeatureError",
    "VLLMKVCache",
    "dense_backend_class",
    "make_backend_class",
]

KV_LAYOUT = KVCacheLayout.LBNHC
"""The one vLLM KV-cache layout whose per-layer tensor has a zero-copy token-major view."""

_VLLM_KV_DTYPES = ("float16", "bfloat16")
"""Dtype names vLLM's ``--kv-cache-dtype`` accepts besides ``auto`` that an attnhost backend may declare."""

VLLM_FP8_KV_DTYPES: dict[str, str] = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""vLLM's ``--kv-cache-dtype`` names of per-tensor-scaled FP8 caches, and the attnhost dtype each stores (vLLM
allocates them as ``uint8``; ``fp8`` means e4m3). vLLM's other quantized caches have no attnhost contract."""


class VLLMKVCache:
    """attnhost's :class:`~attnhost.KVCache` over vLLM's paged per-layer tensors: views, never copies.

    ``views`` (layer id → K view, V view, the vLLM tensor they view) is owned
    by the builder and shared by all its batches: each impl binds its layer
    on its first forward, and again only if vLLM hands it another tensor.
    """

    __slots__ = ("device", "dtype", "page_size", "req_to_token", "views")

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        req_to_token: torch.Tensor,
        views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        page_size: int = 1,
    ) -> None:
        self.device = device
        self.dtype = dtype
        """The cache's dtype: the model's, or with an FP8 ``--kv-cache-dtype`` the float8 dtype vLLM's ``uint8``
        tensor stores (the views are of that dtype)."""
        self.req_to_token = req_to_token
        self.views = views
        self.page_size = page_size
        """vLLM's (kernel) block size: slot ``block * page_size + offset`` is vLLM's ``slot_mapping`` numbering."""

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.views[layer_id][0]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self.views[layer_id][1]

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        # index_copy_ writes through the strided views into vLLM's tensor (see KVPool.set_kv for why not k[loc] = ...)
        k_view, v_view, _ = self.views[layer_id]
        if k_view.dtype.itemsize == 1:  # FP8: the contract's quantising write, through a byte view (no FP8 kernel)
            k_view.view(torch.uint8).index_copy_(0, loc, quantize_fp8(k, k_scale, k_view.dtype).view(torch.uint8))
            v_view.view(torch.uint8).index_copy_(0, loc, quantize_fp8(v, v_scale, v_view.dtype).view(torch.uint8))
            return
        k_view.index_copy_(0, loc, k.to(k_view.dtype))
        v_view.index_copy_(0, loc, v.to(v_view.dtype))

    def set_kv_skipping_padding(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """``set_kv``, except that a row whose slot is ``-1`` (vLLM's padding, and its drafter's rejected tokens)
        writes nowhere, decided on the device: such a row is aimed at the first real row's slot with that row's own
        bytes (or, with no real row, at slot 0 with what slot 0 holds), so every write to one slot carries the same
        bytes and no row is read on the host."""
        k_view, v_view, _ = self.views[layer_id]
        for view, new, scale in ((k_view, k, k_scale), (v_view, v, v_scale)):
            if view.dtype.itemsize == 1:  # FP8: the contract's quantising write, through a byte view
                copy_skipping_padding(
                    view.view(torch.uint8), loc, quantize_fp8(new, scale, view.dtype).view(torch.uint8)
                )
            else:
                copy_skipping_padding(view, loc, new.to(view.dtype))


def copy_skipping_padding(store: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """``store.index_copy_(0, loc, rows)``, except that a row whose slot is ``-1`` writes nowhere, decided on the
    device: such a row is aimed at the first real row's slot with that row's own values (or, with no real row, at
    slot 0 with what slot 0 holds), so every write to one slot carries the same values and nothing is read on the
    host (finding the real rows there would be a synchronisation)."""
    valid = loc >= 0
    first = valid.to(torch.int32).argmax().view(1)  # the first row with a slot; 0 when none has one
    anchor = loc.index_select(0, first).clamp(min=0)
    target = torch.where(valid, loc, anchor)
    anchored = torch.where(valid.any(), rows.index_select(0, first), store.index_select(0, anchor))
    keep = valid.view(-1, *([1] * (rows.dim() - 1)))
    store.index_copy_(0, target, torch.where(keep, rows, anchored))


def host_seq_lens(m: CommonAttentionMetadata, num_reqs: int, query_lens: list[int], *, exact: bool) -> tuple[int, ...]:
    """The requests' lengths on the host: ``exact``, read from the device's ``seq_lens`` (one read, on behalf of a
    backend that plans from exact lengths, as vLLM's host copy is only a bound), else :func:`seq_len_bounds`."""
    if exact:
        return tuple(m.seq_lens[:num_reqs].tolist())
    return seq_len_bounds(m, num_reqs, query_lens)


def seq_len_bounds(m: CommonAttentionMetadata, num_reqs: int, query_lens: list[int]) -> tuple[int, ...]:
    """Host bounds of the requests' lengths, never read from the device: vLLM's ``seq_lens_cpu_upper_bound``
    (exact but for async speculative decode rows, where it assumes every draft was accepted), else its
    ``max_seq_len`` for every request; at least each request's query length."""
    bound = getattr(m, "seq_lens_cpu_upper_bound", None)
    if bound is None:
        return tuple(max(int(m.max_seq_len), q) for q in query_lens)
    return tuple(max(int(n), q) for n, q in zip(bound[:num_reqs].tolist(), query_lens, strict=True))


@dataclass(frozen=True, slots=True)
class AttnhostVLLMMetadata:
    """Per-batch metadata: the attnhost batch (``None`` when no request runs) and the backend that planned it.

    ``causal``: ``False`` for vLLM's non-causal batches (DFlash drafts), which the impl runs with the layer's
    ``is_causal=False`` twin.

    ``written``: in a batch where vLLM marks some new tokens' slots ``-1`` (its drafter's rejected tokens, or tokens
    past the model's length, between other tokens), the rows that do have a slot and their slots; ``None`` when
    every new token has one. Such rows are written by the adapter itself, and the backend runs with
    ``save_kv_cache=False``: a ``-1`` reaches no backend's write, and no slot is read for it.
    """

    batch: ForwardBatch | None
    kv: VLLMKVCache | None
    backend: AttentionBackend
    num_actual_tokens: int
    written: tuple[torch.Tensor, torch.Tensor] | None = None
    causal: bool = True
    writes_all: bool = False
    """The impl writes every new row itself, skipping slot ``-1`` on the device (``set_kv_skipping_padding``), and
    the backend none: a graph-capable backend's batches, where finding the ``-1`` rows on the host would be a read."""


class AttnhostVLLMBackend(VLLMAttentionBackend):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's backend interface over one attnhost backend; :func:`make_backend_class` makes one subclass per name."""

    identity: ClassVar[VLLMIdentity]
    forward_includes_kv_cache_update: bool = True  # the attnhost backend writes new K/V itself (set_kv)
    supports_kv_cache_update_bypass: bool = False

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        """The declared ``BackendCapabilities.page_sizes`` (vLLM then splits larger blocks into them), else any."""
        pages = cls.identity.capabilities.page_sizes
        return [MultipleOf(1)] if pages is None else list(pages)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.identity.capabilities.head_dims)

    @classmethod
    def supports_head_size_v(cls, head_size: int, head_size_v: int) -> bool:
        """vLLM 0.34 asks before handing a layer whose V head size differs from its K head size (MiMo-V2) to the
        backend it was asked for, and takes its own backend for that layer on a no. The contract has one
        ``head_dim`` for K and V, so: equal sizes, of a declared ``BackendCapabilities.head_dims`` (empty: any)."""
        return head_size_v == head_size and cls.supports_head_size(head_size)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KV_LAYOUT,)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the attnhost batch is planned from the host-side query lengths

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return cls.identity.capabilities.sinks and not cls.is_mla()

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return cls.identity.capabilities.sliding_window and not cls.is_mla()

    @classmethod
    def supports_non_causal(cls) -> bool:
        return cls.identity.capabilities.non_causal and not cls.is_mla()

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        """vLLM's own checks against what this class declares, each reason naming the attnhost backend (and the
        capability flag that would answer it)."""
        reasons: list[str] = list(super().validate_configuration(*args, **kwargs))
        if kwargs.get("has_sliding_window") and kwargs.get("use_non_causal") and cls.supports_non_causal():
            reasons.append(WINDOWED_NON_CAUSAL)
        capabilities = cls.identity.capabilities
        cache = {
            "kv_cache_dtype not supported": capabilities.cache_refusal(
                kv_dtype=VLLM_FP8_KV_DTYPES.get(str(kwargs.get("kv_cache_dtype")))
            ),
            "block_size not supported": capabilities.cache_refusal(page_size=kwargs.get("block_size")),
        }
        return [f"{cls.identity.where}: {cache.get(reason) or cls.identity.explain(reason)}" for reason in reasons]


class AttnhostVLLMMetadataBuilder(AttentionMetadataBuilder[AttnhostVLLMMetadata]):  # type: ignore[misc]
    """Builds the attnhost backend once, then one attnhost batch per vLLM batch from ``CommonAttentionMetadata``.

    For a backend that declares ``cuda_graph``, a uniform batch (every request with the same query length, as vLLM
    captures and replays them) is the same attnhost batch object at every step of its size, over buffers
    refreshed in place (:mod:`attnhost.engines.vllm.graphs`); every other batch is built afresh.
    """

    identity: ClassVar[VLLMIdentity]
    graphs_supported: ClassVar[bool] = True
    """Whether this builder serves vLLM's full CUDA graphs for a backend that declares ``cuda_graph``."""
    reorder_batch_threshold: int | None = None
    kv_cache_cls: ClassVar[type[VLLMKVCache]] = VLLMKVCache
    """The attnhost cache over vLLM's tensors that backends get (the MLA builder's reads latent rows)."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.check_spec(kv_cache_spec)
        self.block_size: int = kv_cache_spec.block_size
        self.dtype: torch.dtype = _cache_dtype(self.identity, kv_cache_spec, vllm_config)
        self.device = torch.device(device)
        self._windowed = getattr(kv_cache_spec, "sliding_window", None) is not None
        self._is_draft = serves_draft(kv_cache_spec, layer_names, vllm_config)
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._offsets = torch.arange(self.block_size, dtype=torch.int64, device=self.device)
        self._rows = torch.arange(0, dtype=torch.int64, device=self.device)
        self.graphs: UniformBatches[VLLMKVCache] | None = None
        if self.get_cudagraph_support(vllm_config, kv_cache_spec) != AttentionCGSupport.NEVER:
            self.graphs = UniformBatches(self.device, self.block_size, _graph_tokens(vllm_config), self._cache_over)
        default_host().freeze(by="a vLLM attention metadata builder")
        self.attnhost_backend = self.new_attnhost_backend()

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any) -> AttentionCGSupport:
        """``UNIFORM_BATCH`` for a backend that declares ``cuda_graph``: vLLM then captures decode and speculative
        verify batches (every request with the same query length) whole, padded to the captured size, and runs
        mixed batches between the pieces of its graphs; ``NEVER`` otherwise (vLLM keeps attention out of its
        graphs)."""
        if cls.graphs_supported and cls.identity.capabilities.cuda_graph:
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.NEVER

    def _cache_over(self, req_to_token: torch.Tensor) -> VLLMKVCache:
        return VLLMKVCache(self.device, self.dtype, req_to_token, self.views, self.block_size)

    def check_spec(self, kv_cache_spec: Any) -> None:
        """Refuse a KV-cache group this builder cannot serve (before any backend is built)."""
        _check_spec(self.identity, kv_cache_spec)

    def new_attnhost_backend(self) -> AttentionBackend:
        """A new instance of the attnhost backend, over this builder's cache views, stamped with its name."""
        identity = self.identity
        empty = torch.zeros((0, 0), dtype=torch.int64, device=self.device)
        runner = RunnerView(
            self.device, self.dtype, self._is_draft, self.kv_cache_cls(self.device, self.dtype, empty, self.views)
        )
        backend = identity.build(runner)
        backend.prefill_attention_backend_str = backend.decode_attention_backend_str = identity.attnhost_name
        return backend

    def _query_lens(self, m: CommonAttentionMetadata) -> tuple[list[int], list[int]]:
        """The batch's query starts and each real request's query length: rows past the last real request may be
        padding (no query tokens) and are dropped; an empty request between others is refused."""
        starts: list[int] = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
        query_lens = [end - start for start, end in itertools.pairwise(starts)]
        while query_lens and query_lens[-1] == 0:
            query_lens.pop()
        if 0 in query_lens:
            raise self.identity.refuse("batches with an empty request between others (padded requests)")
        return starts, query_lens

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnhostVLLMMetadata:
        m = common_attn_metadata
        self._check_batch(m, non_causal=self.identity.capabilities.non_causal)
        if m.causal is False and self._windowed:
            raise self.identity.refuse(WINDOWED_NON_CAUSAL)
        starts, query_lens = self._query_lens(m)
        num_reqs = len(query_lens)
        if num_reqs == 0:
            return AttnhostVLLMMetadata(None, None, self.attnhost_backend, 0)
        if self.graphs is not None and m.causal is True:
            q = self.graphs.uniform_query_len(m, query_lens)
            if q is not None:  # a batch vLLM may capture or replay: the same batch object as every step of its size
                uniform, cache = self.graphs.refresh(m, q)
                self._plan(uniform)
                tokens = uniform.num_new_tokens
                return AttnhostVLLMMetadata(uniform, cache, self.attnhost_backend, tokens, writes_all=True)
        seq_lens = m.seq_lens[:num_reqs]
        graph = self.identity.capabilities.cuda_graph
        seq_cpu = host_seq_lens(m, num_reqs, query_lens, exact=not graph)
        prefix_cpu = tuple(s - q for s, q in zip(seq_cpu, query_lens, strict=True))
        if min(prefix_cpu) < 0:
            raise RuntimeError(f"{self.identity.where}: vLLM sent a request with more query tokens than its seq_len")
        num_tokens = starts[num_reqs]
        extend_lens = m.query_start_loc[1 : num_reqs + 1] - m.query_start_loc[:num_reqs]
        if max(query_lens) == 1:
            mode = ForwardMode.DECODE
        else:
            mode = ForwardMode.MIXED if min(query_lens) == 1 else ForwardMode.EXTEND
        pages = self._page_table(m.block_table_tensor, num_reqs, seq_cpu)
        kv = VLLMKVCache(self.device, self.dtype, self._req_to_token(pages), self.views, self.block_size)
        batch = ForwardBatch(
            forward_mode=mode,
            kv_pool=kv,
            req_pool_indices=self._request_rows(num_reqs),
            seq_lens=seq_lens,
            prefix_lens=seq_lens - extend_lens,
            extend_seq_lens=extend_lens,
            out_cache_loc=m.slot_mapping[:num_tokens],
            seq_lens_cpu=seq_cpu,
            prefix_lens_cpu=prefix_cpu,
            extend_seq_lens_cpu=tuple(query_lens),
            host_lengths_exact=not graph,
            # the batch's page_table is vLLM's own block table: the numbers ForwardBatch would rebuild from
            # req_to_token, without the rebuild; slot = block * block_size + offset in both
            pages=pages,
        )
        self._plan(batch)
        if graph:  # the impl writes every row, a padded one (slot -1) nowhere, with no read (set_kv_skipping_padding)
            return AttnhostVLLMMetadata(batch, kv, self.attnhost_backend, num_tokens, None, m.causal is True, True)
        written = _slotted_rows(batch.out_cache_loc)
        return AttnhostVLLMMetadata(batch, kv, self.attnhost_backend, num_tokens, written, m.causal is True)

    def _plan(self, batch: ForwardBatch) -> None:
        try:
            self.attnhost_backend.init_forward_metadata(batch)
        except (Exception, SystemExit) as exc:
            raise self.identity.failed("init_forward_metadata", batch.forward_mode, None, exc) from exc

    def _page_table(self, block_table: torch.Tensor, num_reqs: int, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """vLLM's ``block_table`` as attnhost's ``page_table``: ``[num_reqs, blocks of the longest request]`` int64."""
        blocks = -(-max(seq_lens) // self.block_size)
        return block_table[:num_reqs, :blocks].to(torch.int64)

    def _req_to_token(self, pages: torch.Tensor) -> torch.Tensor:
        """The page table at token level: entry ``[r, p]`` is the slot of token ``p`` of request ``r``."""
        bs = self.block_size
        if bs == 1:
            return pages
        num_reqs, blocks = pages.shape
        return (pages.unsqueeze(-1) * bs + self._offsets).view(num_reqs, blocks * bs)

    def _request_rows(self, num_reqs: int) -> torch.Tensor:
        if self._rows.numel() < num_reqs:
            self._rows = torch.arange(max(num_reqs, 2 * self._rows.numel()), dtype=torch.int64, device=self.device)
        return self._rows[:num_reqs]

    def _check_batch(self, m: CommonAttentionMetadata, non_causal: bool = False) -> None:
        """Refuse what no attnhost batch expresses; a non-causal batch (``causal=False``) only when ``non_causal``
        says the caller serves it."""
        refuse = self.identity.refuse
        if isinstance(m.causal, torch.Tensor):
            raise refuse("per-request causality (a causal tensor in vLLM's metadata)")
        if m.causal is not True and not non_causal:
            raise refuse("non-causal (bidirectional) attention")
        if m.encoder_seq_lens is not None:
            raise refuse("encoder-decoder cross-attention")
        if m.mm_req_doc_ranges:
            raise refuse("bidirectional multimodal prefix ranges (prefix-LM)")
        if m.dcp_local_seq_lens is not None:
            raise refuse("decode context parallelism", "run vLLM with --decode-context-parallel-size 1")
        if m.rswa_prefix_lens is not None:
            raise refuse("reference sliding-window attention (R-SWA)")

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> AttnhostVLLMMetadata:
        """The metadata of a batch vLLM is about to capture: a uniform batch's, planned on its persistent buffers
        (every later step of that size refreshes them in place)."""
        m = common_attn_metadata
        if self.graphs is None:
            raise self.identity.refuse(
                "CUDA-graph capture of attention (it does not declare BackendCapabilities.cuda_graph)",
                "run vLLM with -cc.cudagraph_mode=PIECEWISE or --enforce-eager",
            )
        _, query_lens = self._query_lens(m)
        if m.causal is not True or self.graphs.uniform_query_len(m, query_lens) is None:
            raise self.identity.refuse(
                f"CUDA-graph capture of this batch (query lengths {query_lens} of {m.num_reqs} requests, "
                f"{m.num_actual_tokens} tokens): it captures uniform batches only (AttentionCGSupport.UNIFORM_BATCH), "
                "each request with the same query length, up to vLLM's largest capture size",
                "run vLLM with -cc.cudagraph_mode=FULL_AND_PIECEWISE or PIECEWISE",
            )
        return self.build(0, m)


class AttnhostVLLMImpl(AttentionImpl[AttnhostVLLMMetadata]):  # type: ignore[misc]
    """One vLLM attention layer: checked once at construction, then a thin per-forward call into the backend."""

    identity: ClassVar[VLLMIdentity]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args: Any,
    ) -> None:
        refuse = self.identity.refuse
        sinks = extra_impl_args.pop("sinks", None)  # a variant, served below; the rest must be absent
        refuse_impl_args(
            self.identity,
            alibi_slopes,
            None,
            None,
            attn_type,
            kv_sharing_target_layer_name,
            kv_cache_dtype,
            extra_impl_args,
            "attention",
        )
        self.fp8_dtype: torch.dtype | None = _fp8_dtype(self.identity, kv_cache_dtype)
        head_dims = self.identity.capabilities.head_dims
        if head_dims and head_size not in head_dims:
            raise refuse(f"head size {head_size} (it supports {', '.join(map(str, head_dims))})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.variants: LayerVariants = layer_variants(
            self.identity,
            new_layer_id(),
            num_heads,
            self.num_kv_heads,
            head_size,
            self.scale,
            sliding_window,
            logits_soft_cap,
            sinks,
        )
        self.layer = self.variants.layer
        self.sinks = self.variants.sinks

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttnhostVLLMMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise self.identity.refuse("fused output quantization")
        if attn_metadata is None:
            return output.zero_()  # vLLM's memory-profiling run: no metadata, nothing to attend
        batch, kv = attn_metadata.batch, attn_metadata.kv
        if batch is None or kv is None:
            return output
        if key is None or value is None:
            raise self.identity.refuse("K/V written by a fused op before attention (the KV-cache update bypass)")
        if self.fp8_dtype is not None and layer is not None:  # vLLM sets a layer's scales when it loads weights
            self._take_scales(layer)
        attn_layer = self.layer if attn_metadata.causal else self.variants.bidirectional
        if attn_layer is None:
            raise refuse_non_causal(self.identity, self.variants)
        views = kv.views.get(attn_layer.layer_id)
        if views is None or views[2] is not kv_cache:
            kv.views[attn_layer.layer_id] = self._views(kv_cache)
        n = attn_metadata.num_actual_tokens
        written = attn_metadata.written
        if attn_metadata.writes_all:
            kv.set_kv_skipping_padding(
                attn_layer.layer_id,
                batch.out_cache_loc,
                key[:n],
                value[:n],
                k_scale=attn_layer.k_scale,
                v_scale=attn_layer.v_scale,
            )
        elif written is not None:  # rows without a slot (-1): the others are written here, the backend writes none
            rows, slots = written
            kv.set_kv(
                attn_layer.layer_id,
                slots,
                key.index_select(0, rows),
                value.index_select(0, rows),
                k_scale=attn_layer.k_scale,
                v_scale=attn_layer.v_scale,
            )
        try:  # free when nothing raises; a plugin's exception gets the one line naming it
            out = attn_metadata.backend.forward(
                query[:n],
                key[:n],
                value[:n],
                attn_layer,
                batch,
                written is None and not attn_metadata.writes_all,
                sinks=self.sinks,
            )
        except (Exception, SystemExit) as exc:
            raise self.identity.failed("forward", batch.forward_mode, attn_layer.layer_id, exc) from exc
        output[:n].copy_(out.view(n, attn_layer.num_heads, attn_layer.head_dim))
        return output

    def _take_scales(self, layer: Any) -> None:
        """The vLLM layer's ``_k_scale_float`` / ``_v_scale_float`` into the attnhost layers, when they changed
        (vLLM sets them after the impl is built, from the checkpoint or to 1.0): two float reads per forward."""
        k_scale, v_scale = float(layer._k_scale_float), float(layer._v_scale_float)
        if k_scale == self.layer.k_scale and v_scale == self.layer.v_scale:
            return
        variants = self.variants
        twin = variants.bidirectional
        self.variants = dataclasses.replace(
            variants,
            layer=dataclasses.replace(variants.layer, k_scale=k_scale, v_scale=v_scale),
            bidirectional=None if twin is None else dataclasses.replace(twin, k_scale=k_scale, v_scale=v_scale),
        )
        self.layer = self.variants.layer

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zero-copy ``[num_slots, kv_heads, head_size]`` K and V views of one layer's vLLM cache, checked; an FP8
        cache (``uint8`` in vLLM) is viewed as its float8 dtype."""
        heads, dim = self.num_kv_heads, self.head_size
        if kv_cache.dim() != 4 or kv_cache.shape[1] != heads or kv_cache.shape[3] != 2 * dim:
            raise self.identity.refuse(
                f"a KV cache of shape {tuple(kv_cache.shape)} (it reads vLLM's "
                f"[blocks, {heads} kv_heads, block_size, {2 * dim}] cache with K and V on the last axis)"
            )
        cache = kv_cache
        if self.fp8_dtype is not None:
            if kv_cache.dtype not in (torch.uint8, self.fp8_dtype):
                raise self.identity.refuse(
                    f"an FP8 KV cache (--kv-cache-dtype {self.kv_cache_dtype}) held in a {dtype_name(kv_cache.dtype)} "
                    "tensor (vLLM allocates FP8 caches as uint8)"
                )
            cache = kv_cache.view(self.fp8_dtype)
        elif is_quantized_kv_cache(self.kv_cache_dtype) or not kv_cache.dtype.is_floating_point:
            raise self.identity.refuse(f"a KV cache of dtype {dtype_name(kv_cache.dtype)}")
        else:
            reason = self.identity.capabilities.refusal(dtype=dtype_name(kv_cache.dtype), head_dim=dim)
            if reason is not None:
                raise self.identity.refuse(reason, "choose another --dtype or --attention-backend")
        try:
            flat = cache.transpose(1, 2).view(-1, heads, 2 * dim)
        except RuntimeError:
            raise self.identity.refuse(
                f"this KV-cache layout (strides {tuple(kv_cache.stride())}): it reads the {KV_LAYOUT.name} "
                "layout, where the cache has a zero-copy token-major view",
                f"set VLLM_KV_CACHE_LAYOUT={KV_LAYOUT.name} or pair it with backends that accept {KV_LAYOUT.name}",
            ) from None
        return flat[..., :dim], flat[..., dim:], kv_cache


def _graph_tokens(vllm_config: Any) -> int:
    """The most tokens vLLM captures in one graph: its largest capture size, or (before vLLM resolved its sizes)
    as many as it schedules requests."""
    largest = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None)
    return int(largest or vllm_config.scheduler_config.max_num_seqs)


def _fp8_dtype(identity: VLLMIdentity, kv_cache_dtype: str) -> torch.dtype | None:
    """The float8 dtype an FP8 ``--kv-cache-dtype`` stores, refused by name where the backend does not read it;
    ``None`` for a float cache."""
    name = VLLM_FP8_KV_DTYPES.get(kv_cache_dtype)
    if name is None:
        return None
    reason = identity.capabilities.cache_refusal(kv_dtype=name)
    if reason is not None:
        raise identity.refuse(
            f"{reason}, asked by vLLM as --kv-cache-dtype {kv_cache_dtype}",
            "use --kv-cache-dtype auto or choose another --attention-backend (e.g. torch_native)",
        )
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _cache_dtype(identity: VLLMIdentity, spec: Any, vllm_config: Any) -> torch.dtype:
    """The dtype of a KV-cache group's entries: the spec's, or with an FP8 cache (``uint8`` in the spec; which
    format is the cache config's ``cache_dtype``) its float8 dtype, refused by name where the backend does not
    read it. The block size is checked here too: vLLM's selector may be bypassed, and it never sees a kernel
    block size."""
    page = identity.capabilities.cache_refusal(page_size=spec.block_size)
    if page is not None:
        sizes = identity.capabilities.page_sizes or ()
        raise identity.refuse(
            f"{page}, asked by vLLM as --block-size {spec.block_size}",
            f"run vLLM with --block-size {sizes[0]} (or a multiple of one it reads) or choose another "
            "--attention-backend",
        )
    if spec.kv_quant_mode == KVQuantMode.NONE:
        dtype: torch.dtype = spec.dtype
        return dtype
    config = getattr(vllm_config, "cache_config", None)
    asked = str(getattr(config, "cache_dtype", "fp8"))
    fp8 = _fp8_dtype(identity, asked)
    if fp8 is None:
        raise identity.refuse(f"a quantized KV cache ({spec.kv_quant_mode.name}, --kv-cache-dtype {asked})")
    return fp8


def refuse_impl_args(
    identity: VLLMIdentity,
    alibi_slopes: object,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    attn_type: str,
    kv_sharing_target_layer_name: str | None,
    kv_cache_dtype: str,
    extra_impl_args: dict[str, Any],
    kind: str,
) -> None:
    """What vLLM may ask of an impl (dense or MLA) and the attnhost contract cannot express, refused by name when
    vLLM builds the layer. ``kind`` names the attention in the messages ("attention", "MLA")."""
    refuse = identity.refuse
    if alibi_slopes is not None:
        raise refuse("ALiBi position biases")
    if sliding_window is not None:
        raise refuse(f"sliding-window {kind} (window {sliding_window})")
    if logits_soft_cap:
        raise refuse(f"logit soft-capping (logits_soft_cap={logits_soft_cap})")
    if attn_type != AttentionType.DECODER:
        raise refuse(f"{AttentionType(attn_type).value} attention (it computes decoder self-attention)")
    if kv_sharing_target_layer_name is not None:
        raise refuse(f"KV-cache sharing between layers (target {kv_sharing_target_layer_name})")
    if is_quantized_kv_cache(kv_cache_dtype) and not (kind == "attention" and kv_cache_dtype in VLLM_FP8_KV_DTYPES):
        cache = "KV cache" if kind == "attention" else f"{kind} cache"
        raise refuse(f"a quantized {cache} (--kv-cache-dtype {kv_cache_dtype})", "use --kv-cache-dtype auto")
    if extra_impl_args.get("sinks") is not None:
        raise refuse("attention sinks")
    # "is not": a tensor argument compares equal to False when it is all zeros, and must still be refused
    extra = sorted(name for name, value in extra_impl_args.items() if value is not None and value is not False)
    if extra:
        raise refuse(f"the extra {kind} arguments {', '.join(extra)}")


def serves_draft(spec: Any, layer_names: list[str], vllm_config: Any) -> bool:
    """Whether a builder's KV-cache group holds the speculative drafter's layers (its backend is then a draft's).

    Where vLLM's ``AttentionSpec`` has ``is_draft`` (0.33) it marks the drafter's group. Where it has not (0.32),
    the drafter's attention layers are those that registered in vLLM's forward context after all of the target
    model's (vLLM loads the target first, then the drafter; the drafter gets builders of its own).
    """
    flag = getattr(spec, "is_draft", None)
    if flag is not None:
        return bool(flag)
    if getattr(vllm_config, "speculative_config", None) is None or not layer_names:
        return False
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    context = vllm_config.compilation_config.static_forward_context
    attention = [name for name, layer in context.items() if isinstance(layer, AttentionLayerBase)]
    target = vllm_config.model_config.get_num_layers_by_block_type(vllm_config.parallel_config, "attention")
    return set(layer_names).isdisjoint(attention[:target])


def _slotted_rows(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of a batch's new tokens that have a slot, and their slots, when some have none (``-1``)."""
    has_slot = slot_mapping >= 0
    if bool(has_slot.all()):  # one read per batch; the usual answer
        return None
    rows = has_slot.nonzero().squeeze(1)
    return rows, slot_mapping.index_select(0, rows)


def _check_spec(identity: VLLMIdentity, spec: Any) -> None:
    """Refuse, at builder construction, a KV-cache group the attnhost contract cannot serve."""
    refuse = identity.refuse
    if isinstance(spec, MLAAttentionSpec):
        way_out = identity.sibling_way_out(True)
        if way_out is not None:
            raise refuse("MLA (multi-head latent attention) under its dense name", way_out)
        raise refuse("MLA (multi-head latent attention): it does not declare BackendCapabilities.mla")
    for kind, feature in (
        (ChunkedLocalAttentionSpec, "chunked local attention"),
        (CrossAttentionSpec, "encoder-decoder cross-attention"),
        (EncoderOnlyAttentionSpec, "encoder-only (bidirectional) attention"),
        (RSWASpec, "reference sliding-window attention (R-SWA)"),
    ):
        if isinstance(spec, kind):
            raise refuse(feature)
    if not isinstance(spec, AttentionSpec):
        raise refuse(f"vLLM's {type(spec).__name__} KV-cache groups (it reads attention KV caches)")
    capabilities = identity.capabilities
    window = getattr(spec, "sliding_window", None)
    if window is not None and not capabilities.sliding_window:
        raise refuse(f"sliding-window attention (vLLM sliding_window={window}; it does not declare sliding_window)")
    if isinstance(spec, FullAttentionSpec) and spec.attention_chunk_size:
        raise refuse("chunked local attention")
    if getattr(spec, "non_causal", False) and not capabilities.non_causal:
        raise refuse("non-causal (bidirectional) attention (it does not declare non_causal)")
    if spec.head_size_v != spec.head_size:
        raise refuse(f"a V head size ({spec.head_size_v}) unlike the QK head size ({spec.head_size})")
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise refuse(f"a quantized KV cache ({spec.kv_quant_mode.name})", "use --kv-cache-dtype auto or fp8")
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise refuse("a packed KV-cache page (custom head slots or state sizes)")
    if spec.kv_quant_mode == KVQuantMode.NONE:
        reason = identity.capabilities.refusal(dtype=dtype_name(spec.dtype), head_dim=spec.head_size)
    else:  # an FP8 cache (uint8 in the spec): its format is checked with the config, in _cache_dtype
        head_dims = identity.capabilities.head_dims
        reason = None if not head_dims or spec.head_size in head_dims else f"head dim {spec.head_size}"
    if reason is not None:
        raise refuse(reason, "choose another --dtype, --kv-cache-dtype or --attention-backend")


def named_class(identity: VLLMIdentity, base: type[Any], suffix: str, namespace: dict[str, Any]) -> type[Any]:
    """A subclass of ``base`` for one vLLM name, where vLLM's ``resolve_obj_by_qualname`` and pickle find it
    (``attnhost.engines.vllm.backends.<engine_name>``)."""
    name = identity.engine_name
    cls = type(f"{name}{suffix}", (base,), {"identity": identity, **namespace})
    cls.__module__ = BACKENDS_MODULE
    cls.__qualname__ = f"{name}.{suffix}" if suffix else name
    cls.__doc__ = f"attnhost backend {identity.attnhost_name!r} ({identity.origin}) as vLLM's {name}{suffix}."
    return cls


def supported_dtypes(capabilities: BackendCapabilities, fp8: bool = True) -> dict[str, Any]:
    """vLLM's ``supported_dtypes`` / ``supported_kv_cache_dtypes`` from what the backend declares: its float
    cache dtypes, and vLLM's FP8 names (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) of the FP8 formats it declares in
    ``kv_cache_dtypes`` where ``fp8`` (an MLA latent cache stays float)."""
    dtypes = [
        getattr(torch, name) for name in capabilities.dtypes if isinstance(getattr(torch, name, None), torch.dtype)
    ]
    kv_dtypes = [
        "auto",
        *(n for n in capabilities.dtypes if n in _VLLM_KV_DTYPES and capabilities.reads_kv_cache_dtype(n)),
    ]
    if fp8:
        kv_dtypes += [vllm for vllm, name in VLLM_FP8_KV_DTYPES.items() if capabilities.reads_kv_cache_dtype(name)]
    return {"supported_dtypes": dtypes, "supported_kv_cache_dtypes": kv_dtypes}


def make_backend_class(
    engine_name: str, backend: ExportedBackend, sibling: str | None = None
) -> type[AttnhostVLLMBackend]:
    """The vLLM backend class for one vLLM name: its own backend, builder and impl subclasses (``sibling``: the
    vLLM name of the backend's MLA twin, if it has one)."""
    return dense_backend_class(identify(engine_name, backend, sibling))


def dense_backend_class(identity: VLLMIdentity) -> type[AttnhostVLLMBackend]:
    """The dense backend class, with its own builder and impl subclasses, for the backend ``identity`` names."""
    engine_name = identity.engine_name
    impl = named_class(identity, AttnhostVLLMImpl, "Impl", {})
    builder = named_class(identity, AttnhostVLLMMetadataBuilder, "Builder", {})
    cls: type[AttnhostVLLMBackend] = named_class(
        identity,
        AttnhostVLLMBackend,
        "",
        {
            **supported_dtypes(identity.capabilities),
            "get_name": staticmethod(lambda: engine_name),
            "get_impl_cls": staticmethod(lambda: impl),
            "get_builder_cls": staticmethod(lambda: builder),
            "Impl": impl,
            "Builder": builder,
        },
    )
    return cls
