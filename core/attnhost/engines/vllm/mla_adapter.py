"""vLLM's MLA interface (``MLACommonBackend``, ``MLAAttentionImpl``) over an attnhost backend that declares ``mla``.

How vLLM calls an MLA layer (``MLAAttention.forward``, vllm/model_executor/layers/attention/mla_attention.py):

1. ``impl.do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, ...)`` writes the new tokens' latent rows;
2. the layer splits the batch at the metadata's ``num_decode_tokens``. The first tokens get the key up-projection
   absorbed into their queries by the layer (``W_UK``) and go to ``impl.forward_mqa(q, kv_cache, metadata, layer)``,
   which returns ``[tokens, heads, kv_lora_rank]`` for the layer to up-project (``W_UV``); the rest go to
   ``impl.forward_mha(q, kv_c_normed, k_pe, kv_cache, metadata, k_scale, output)``, which decompresses their keys
   and values with the layer's ``kv_b_proj`` and writes ``[tokens, heads * v_head_dim]`` into ``output``.

Those are attnhost's two MLA forms (docs/mla.md): ``forward_mqa`` is ``forward_mla_mqa`` with the rope part passed
apart (``q_rope``) over the latent rows already in the cache (``save_kv_cache=False``), ``forward_mha`` is
``forward_mla_mha`` over the decompressed ``k``/``v``. attnhost's MHA form attends over its arguments only, so
the builder sends a prefill with a cached prefix (prefix caching, chunked prefill) to the absorbed form, with the
rest of its batch: decode-like requests (at most ``reorder_batch_threshold`` new tokens, vLLM's own split) and
every request of a batch in which any prefill has a prefix are absorbed; the prefills of a batch in which none
has a prefix take the MHA form, which costs far less per new token than the absorbed one.

The cache, without a copy: vLLM's MLA cache is, per layer, ``[blocks, block_size, kv_lora_rank +
qk_rope_head_dim]`` (one KV head: each token's latent ``c_kv`` then its rotary ``k_pe``). In a layer-compact
layout (the L axis outermost) one layer's blocks are one token-major run, so ``cache.view(-1, 1, width)`` is
attnhost's ``k_buffer`` (``[slots, 1, latent_dim]``, slot ``block * block_size + offset``: vLLM's
``slot_mapping`` numbering) and its first ``kv_lora_rank`` columns the ``v_buffer``: SGLang's
``MLATokenToKVPool`` layout, which the contract takes as it is.

Two attnhost backend instances per builder: one vLLM batch can hold both forms (its decodes and its prefills),
each an attnhost batch that a backend plans in ``init_forward_metadata``, and a backend serves the batch it
planned last (the contract's rule, SGLang's), so each form gets its own instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonPrefillMetadata,
)
from vllm.v1.attention.backend import CommonAttentionMetadata, MLAAttentionImpl
from vllm.v1.kv_cache_interface import (
    KVCacheLayout,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
    is_quantized_kv_cache,
)

from attnhost.backend import AttentionBackend, AttentionLayer, dtype_name
from attnhost.engines.vllm.adapter import (
    AttnhostVLLMBackend,
    AttnhostVLLMMetadataBuilder,
    VLLMKVCache,
    copy_skipping_padding,
    host_seq_lens,
    named_class,
    refuse_impl_args,
    supported_dtypes,
)
from attnhost.engines.vllm.identity import VLLMIdentity, identify
from attnhost.engines.vllm.names import new_layer_id
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.mla import MLAConfig, MLAForm

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from attnhost.engines.export import ExportedBackend

__all__ = [
    "MLA_KV_LAYOUTS",
    "AttnhostVLLMMLABackend",
    "AttnhostVLLMMLAImpl",
    "AttnhostVLLMMLAMetadata",
    "AttnhostVLLMMLAMetadataBuilder",
    "VLLMLatentCache",
    "make_mla_backend_class",
    "mla_backend_class",
]

MLA_KV_LAYOUTS = (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.LHBNC)
"""The layer-compact layouts, the dense adapter's first: with one KV head they are one memory order, in which a
layer's latent rows have a zero-copy token-major view."""


class VLLMLatentCache(VLLMKVCache):
    """attnhost's latent cache over vLLM's MLA tensors: ``k_buffer`` the rows, ``v_buffer`` their first
    ``kv_lora_rank`` columns (views, bound per layer by its impl), ``set_kv`` writes whole rows."""

    __slots__ = ()

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        rows = self.views[layer_id][0]
        rows.index_copy_(0, loc, k.reshape(-1, 1, rows.shape[-1]).to(rows.dtype))


class _Form(NamedTuple):
    """One form's share of a vLLM batch: the attnhost batch, the backend instance that planned it, its cache."""

    batch: ForwardBatch
    backend: AttentionBackend
    kv: VLLMLatentCache


@dataclass
class AttnhostVLLMMLAMetadata(MLACommonMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's MLA metadata (what ``MLAAttention`` reads: the decode/prefill split) and each form's attnhost batch."""

    absorbed: _Form | None = None
    """The first ``num_decode_tokens`` tokens, served by ``forward_mqa``."""
    mha: _Form | None = None
    """The rest (prefills without a cached prefix), served by ``forward_mha``."""


class AttnhostVLLMMLABackend(AttnhostVLLMBackend, MLACommonBackend):  # type: ignore[misc]
    """vLLM's MLA backend interface over one attnhost backend; :func:`make_mla_backend_class` makes one per name."""

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent width: BackendCapabilities.head_dims constrains dense layers only

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return MLA_KV_LAYOUTS


class AttnhostVLLMMLAMetadataBuilder(AttnhostVLLMMetadataBuilder):
    """Splits each vLLM batch between the two forms and plans each part on its own attnhost backend instance."""

    kv_cache_cls = VLLMLatentCache
    reorder_batch_threshold: int | None = 1
    graphs_supported = False  # the two forms' split is per batch: vLLM keeps MLA attention out of its graphs

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # checks the spec; the absorbed backend
        self.mha_backend = self.new_attnhost_backend()
        # speculative verification (a few new tokens over a prefix) is a decode here: the absorbed form serves it
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def check_spec(self, kv_cache_spec: Any) -> None:
        _check_mla_spec(self.identity, kv_cache_spec)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnhostVLLMMLAMetadata:
        m = common_attn_metadata
        self._check_batch(m)
        starts, query_lens = self._query_lens(m)
        num_reqs = len(query_lens)
        if num_reqs == 0:
            return AttnhostVLLMMLAMetadata(
                num_reqs=0,
                max_query_len=0,
                max_seq_len=0,
                num_actual_tokens=0,
                query_start_loc=m.query_start_loc[:1],
                slot_mapping=m.slot_mapping[:0],
                num_decodes=0,
                num_decode_tokens=0,
                num_prefills=0,
            )
        seq_lens = m.seq_lens[:num_reqs]
        exact = not self.identity.capabilities.cuda_graph
        # a graph-capable backend plans from vLLM's host bounds (exact for prefill rows, which alone take the MHA
        # form); any other plans from exact lengths, read on its behalf
        seq_cpu = host_seq_lens(m, num_reqs, query_lens, exact=exact)
        prefix_cpu = tuple(s - q for s, q in zip(seq_cpu, query_lens, strict=True))
        if min(prefix_cpu) < 0:
            raise RuntimeError(f"{self.identity.where}: vLLM sent a request with more query tokens than its seq_len")
        threshold = self.reorder_batch_threshold or 1
        split = next((i for i, n in enumerate(query_lens) if n > threshold), num_reqs)
        if any(prefix_cpu[split:]):  # a prefill over cached latent rows: only the absorbed form reads them
            split = num_reqs
        slots = self._req_to_token(self._page_table(m.block_table_tensor, num_reqs, seq_cpu))
        kv = VLLMLatentCache(self.device, self.dtype, slots, self.views, self.block_size)
        rows = self._request_rows(num_reqs)
        extend_lens = m.query_start_loc[1 : num_reqs + 1] - m.query_start_loc[:num_reqs]

        def form(lo: int, hi: int, backend: AttentionBackend) -> _Form:
            lens = tuple(query_lens[lo:hi])
            mode = ForwardMode.DECODE if max(lens) == 1 else ForwardMode.MIXED if min(lens) == 1 else ForwardMode.EXTEND
            batch = ForwardBatch(
                forward_mode=mode,
                kv_pool=kv,
                req_pool_indices=rows[lo:hi],
                seq_lens=seq_lens[lo:hi],
                prefix_lens=seq_lens[lo:hi] - extend_lens[lo:hi],
                extend_seq_lens=extend_lens[lo:hi],
                out_cache_loc=m.slot_mapping[starts[lo] : starts[hi]],
                seq_lens_cpu=seq_cpu[lo:hi],
                prefix_lens_cpu=prefix_cpu[lo:hi],
                extend_seq_lens_cpu=lens,
                host_lengths_exact=exact,
            )
            try:
                backend.init_forward_metadata(batch)
            except (Exception, SystemExit) as exc:
                raise self.identity.failed("init_forward_metadata", batch.forward_mode, None, exc) from exc
            return _Form(batch, backend, kv)

        block_table = m.block_table_tensor
        return AttnhostVLLMMLAMetadata(
            num_reqs=num_reqs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_cpu),
            num_actual_tokens=starts[num_reqs],
            query_start_loc=m.query_start_loc[: num_reqs + 1],
            slot_mapping=m.slot_mapping[: starts[num_reqs]],
            num_decodes=split,
            num_decode_tokens=starts[split],
            num_prefills=num_reqs - split,
            decode=MLACommonDecodeMetadata(block_table[:split], seq_lens[:split], None) if split else None,
            prefill=MLACommonPrefillMetadata(
                block_table[split:num_reqs],
                m.query_start_loc[split : num_reqs + 1] - starts[split],
                max(query_lens[split:]),
            )
            if split < num_reqs
            else None,
            absorbed=form(0, split, self.attnhost_backend) if split else None,
            mha=form(split, num_reqs, self.mha_backend) if split < num_reqs else None,
        )


class AttnhostVLLMMLAImpl(MLAAttentionImpl[AttnhostVLLMMLAMetadata]):  # type: ignore[misc]
    """One vLLM MLA layer: checked once at construction; per forward, a thin call into the form's backend."""

    identity: ClassVar[VLLMIdentity]
    can_return_lse_for_decode: bool = False
    supports_pcp: bool = False
    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj: Any,
        indexer: object | None = None,
        q_pad_num_heads: int | None = None,
        **extra_impl_args: Any,
    ) -> None:
        refuse = self.identity.refuse
        if not self.identity.capabilities.mla:
            raise refuse("MLA models (multi-head latent attention): it does not declare BackendCapabilities.mla")
        if indexer is not None:
            raise refuse("DeepSeek sparse attention (an MLA layer with a top-k indexer)")
        refuse_impl_args(
            self.identity,
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            kv_cache_dtype,
            extra_impl_args,
            "MLA",
        )
        if num_kv_heads != 1 or head_size != kv_lora_rank + qk_rope_head_dim:
            raise refuse(
                f"an MLA layer with {num_kv_heads} KV heads of size {head_size} (vLLM's latent cache has one of "
                f"kv_lora_rank + qk_rope_head_dim = {kv_lora_rank + qk_rope_head_dim})"
            )
        if qk_head_dim != qk_nope_head_dim + qk_rope_head_dim:
            raise refuse(f"qk_head_dim {qk_head_dim} unlike qk_nope_head_dim + qk_rope_head_dim")
        if self.dcp_world_size > 1:
            raise refuse("decode context parallelism", "run vLLM with --decode-context-parallel-size 1")
        if self.pcp_world_size > 1:
            raise refuse("prefill context parallelism", "run vLLM with --prefill-context-parallel-size 1")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = 1
        self.kv_cache_dtype = kv_cache_dtype
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        self.indexer = None
        self.q_pad_num_heads = None  # the attnhost backend takes the heads as they are; the layer pads nothing
        self.mla = MLAConfig(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
        layer_id = new_layer_id()
        self.absorbed_layer = AttentionLayer.for_mla(self.mla, MLAForm.ABSORBED, layer_id, num_heads, self.scale)
        self.mha_layer = AttentionLayer.for_mla(self.mla, MLAForm.MHA, layer_id, num_heads, self.scale)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (vLLM's tensor, its latent rows)

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """Write the new tokens' latent rows (``c_kv`` then ``k_pe``) at ``slot_mapping``, the padded tail
        (slot ``-1``) skipped: the caller writes the latent in both of attnhost's forms as vLLM runs them."""
        if kv_cache.numel() == 0:  # vLLM's memory-profiling run
            return
        latent = self._latent_rows(kv_cache)[:, 0]
        slots = slot_mapping.reshape(-1)
        n = slots.shape[0]
        rank = self.kv_lora_rank
        if self.identity.capabilities.cuda_graph:  # padded rows skipped on the device: no read in a step
            copy_skipping_padding(latent[:, :rank], slots, kv_c_normed[:n].to(latent.dtype))
            if self.qk_rope_head_dim:
                copy_skipping_padding(latent[:, rank:], slots, k_pe[:n].reshape(n, -1).to(latent.dtype))
            return
        if n and int(slots[n - 1]) < 0:  # vLLM pads with -1 after the last real token
            n = int((slots >= 0).sum())
            if n and int(slots[n - 1]) < 0:
                raise self.identity.refuse(
                    "padding slots (-1) between real tokens in slot_mapping (context parallelism)",
                    "run vLLM without decode or prefill context parallelism",
                )
            slots = slots[:n]
        latent[:, :rank].index_copy_(0, slots, kv_c_normed[:n].to(latent.dtype))
        if self.qk_rope_head_dim:
            latent[:, rank:].index_copy_(0, slots, k_pe[:n].reshape(n, -1).to(latent.dtype))

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: AttnhostVLLMMLAMetadata,
        layer: Any,
    ) -> tuple[torch.Tensor, None]:
        """The absorbed form: ``q`` is ``(q_nope W_UK, q_pe)`` (or joined); returns ``[tokens, heads, rank]``."""
        form = self._form(attn_metadata.absorbed, "forward_mqa")
        q_nope, q_rope = q if isinstance(q, tuple) else (q, None)
        self._check_tokens(q_nope, form, "forward_mqa")
        self._bind(form.kv, kv_c_and_k_pe_cache)
        layer_id = self.absorbed_layer.layer_id
        try:
            out = form.backend.forward_mla_mqa(q_nope, None, None, self.absorbed_layer, form.batch, False, q_rope, None)
        except (Exception, SystemExit) as exc:
            raise self.identity.failed("forward_mla_mqa", form.batch.forward_mode, layer_id, exc) from exc
        return out if out.is_contiguous() else out.contiguous(), None

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: AttnhostVLLMMLAMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """The MHA form: keys and values decompressed with the layer's ``kv_b_proj``, as vLLM's MLA backends do,
        then causal attention over them into ``output`` (``[tokens, heads * v_head_dim]``)."""
        if output_scale is not None:
            raise self.identity.refuse("fused output quantization")
        form = self._form(attn_metadata.mha, "forward_mha")
        self._check_tokens(q, form, "forward_mha")
        self._bind(form.kv, kv_c_and_k_pe_cache)
        n, heads, nope, v_dim = q.shape[0], self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        kv_nope = self.kv_b_proj(kv_c_normed)[0].view(n, heads, nope + v_dim)
        k = q.new_empty((n, heads, self.qk_head_dim))
        k[..., :nope] = kv_nope[..., :nope]
        k[..., nope:] = k_pe  # one rotary key per token, shared by every head
        try:
            out = form.backend.forward_mla_mha(q, k, kv_nope[..., nope:], self.mha_layer, form.batch)
        except (Exception, SystemExit) as exc:
            raise self.identity.failed(
                "forward_mla_mha", form.batch.forward_mode, self.mha_layer.layer_id, exc
            ) from exc
        output.view(n, heads, v_dim).copy_(out.view(n, heads, v_dim))

    def _form(self, form: _Form | None, method: str) -> _Form:
        if form is None:
            raise RuntimeError(
                f"{self.identity.where}: vLLM called {method} for a batch whose metadata gives that form no "
                "tokens; build the metadata with this backend's own builder"
            )
        return form

    def _check_tokens(self, q: torch.Tensor, form: _Form, method: str) -> None:
        if q.shape[0] != form.batch.num_new_tokens:
            raise RuntimeError(
                f"{self.identity.where}: vLLM called {method} with {q.shape[0]} query rows for the "
                f"{form.batch.num_new_tokens} tokens its metadata gives that form"
            )

    def _bind(self, kv: VLLMLatentCache, kv_cache: torch.Tensor) -> None:
        """This layer's latent views in the builder's cache object, bound on its first forward (and again only
        if vLLM hands it another tensor)."""
        layer_id = self.absorbed_layer.layer_id
        views = kv.views.get(layer_id)
        if views is None or views[2] is not kv_cache:
            rows = self._latent_rows(kv_cache)
            kv.views[layer_id] = (rows, rows[..., : self.kv_lora_rank], kv_cache)

    def _latent_rows(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``[slots, 1, latent_dim]``: a zero-copy view of one layer's vLLM cache, checked once per tensor."""
        known = self._rows
        if known is not None and known[0] is kv_cache:
            return known[1]
        refuse, width = self.identity.refuse, self.mla.latent_dim
        cache = kv_cache.squeeze(1) if kv_cache.dim() == 4 and kv_cache.shape[1] == 1 else kv_cache
        if cache.dim() != 3 or cache.shape[2] != width:
            raise refuse(
                f"an MLA cache of shape {tuple(kv_cache.shape)} (it reads vLLM's [blocks, block_size, {width}] "
                f"latent cache: kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim {self.qk_rope_head_dim})"
            )
        if not cache.dtype.is_floating_point:
            raise refuse(f"an MLA cache of dtype {dtype_name(cache.dtype)}", "use --kv-cache-dtype auto")
        reason = self.identity.capabilities.refusal(dtype=dtype_name(cache.dtype), head_dim=width, mla=True)
        if reason is not None:
            raise refuse(reason, "choose another --dtype or --attention-backend")
        try:
            rows = cache.view(-1, 1, width)
        except RuntimeError:
            layouts = ", ".join(layout.name for layout in MLA_KV_LAYOUTS)
            raise refuse(
                f"this MLA cache layout (strides {tuple(kv_cache.stride())}): it reads a layer-compact layout "
                f"({layouts}), where a layer's latent rows have a zero-copy token-major view",
                f"set VLLM_KV_CACHE_LAYOUT={MLA_KV_LAYOUTS[0].name} or pair it with backends that accept it",
            ) from None
        self._rows = (kv_cache, rows)
        return rows


def _check_mla_spec(identity: VLLMIdentity, spec: Any) -> None:
    """Refuse, at builder construction, a KV-cache group this MLA name cannot serve."""
    refuse = identity.refuse
    if not identity.capabilities.mla:
        raise refuse("MLA models (multi-head latent attention): it does not declare BackendCapabilities.mla")
    if isinstance(spec, SlidingWindowSpec):
        raise refuse("sliding-window MLA")
    if not isinstance(spec, MLAAttentionSpec):
        raise refuse(
            f"vLLM's {type(spec).__name__} KV-cache groups (dense attention) under its MLA name",
            identity.sibling_way_out(False) or "choose another --attention-backend",
        )
    if spec.num_kv_heads != 1:
        raise refuse(f"an MLA cache with {spec.num_kv_heads} KV heads (vLLM's latent cache has one)")
    if spec.kv_quant_mode != KVQuantMode.NONE or is_quantized_kv_cache(spec.cache_dtype_str or "auto"):
        raise refuse(
            f"a quantized MLA cache ({spec.cache_dtype_str or spec.kv_quant_mode.name})", "use --kv-cache-dtype auto"
        )
    if spec.topk_buffer_width is not None or spec.is_index_group_leader:
        raise refuse("DeepSeek sparse attention (a top-k MLA cache group)")
    if spec.model_version is not None:
        raise refuse(f"the {spec.model_version} MLA cache (compressed per-token states)")
    if spec.non_causal_multi_token_decode:
        raise refuse("non-causal multi-token decode")
    if (
        spec.num_head_slots is not None
        or spec.state_content_bytes is not None
        or spec.tokens_per_state != 1
        or spec.alignment is not None
    ):
        raise refuse("a packed or padded MLA cache page")
    reason = identity.capabilities.refusal(dtype=dtype_name(spec.dtype), head_dim=spec.head_size, mla=True)
    if reason is not None:
        raise refuse(reason, "choose another --dtype, --kv-cache-dtype or --attention-backend")


def make_mla_backend_class(engine_name: str, backend: ExportedBackend, sibling: str) -> type[AttnhostVLLMMLABackend]:
    """The vLLM MLA backend class for one MLA name (``sibling``: the backend's dense vLLM name)."""
    return mla_backend_class(identify(engine_name, backend, sibling))


def mla_backend_class(identity: VLLMIdentity) -> type[AttnhostVLLMMLABackend]:
    """The MLA backend class, with its own builder and impl subclasses, for the backend ``identity`` names."""
    impl = named_class(identity, AttnhostVLLMMLAImpl, "Impl", {})
    builder = named_class(identity, AttnhostVLLMMLAMetadataBuilder, "Builder", {})
    cls: type[AttnhostVLLMMLABackend] = named_class(
        identity,
        AttnhostVLLMMLABackend,
        "",
        {
            **supported_dtypes(identity.capabilities, fp8=False),
            "get_name": staticmethod(lambda: identity.engine_name),
            "get_impl_cls": staticmethod(lambda: impl),
            "get_builder_cls": staticmethod(lambda: builder),
            "Impl": impl,
            "Builder": builder,
        },
    )
    return cls
