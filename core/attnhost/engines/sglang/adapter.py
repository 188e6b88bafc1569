"""An SGLang ``AttentionBackend`` that runs an attnhost backend on SGLang's own pools.

SGLang builds one adapter per model runner through its ``ATTENTION_BACKENDS``
registry, and each adapter builds its own attnhost backend, so the target
and the draft never share one (docs/architecture.md). Per batch, SGLang's
``ForwardBatch`` becomes an attnhost :class:`~attnhost.ForwardBatch` whose
KV cache is a thin view of SGLang's ``MHATokenToKVPool`` and
``ReqToTokenPool``: the buffers handed to the backend are SGLang's own
tensors, never copies. Per layer, the adapter only looks the layer up in a
dict and views ``q`` and the result between SGLang's ``[tokens, heads *
head_dim]`` and the contract's ``[tokens, heads, head_dim]``; a backend that
declares ``flat_heads`` takes SGLang's layout itself and is spared both
views (at about 2 us each on a CPU, they are a few per cent of a small
decode call).

Speculative batches: TARGET_VERIFY (each request's draft tokens after its
committed prefix; a tree's ``custom_mask`` becomes the contract's
``tree_mask``) and DRAFT_EXTEND_V2 read their keys through a per-batch
slot table (:func:`slot_table`), since SGLang's own backends take the new
tokens' K/V from the write slots, not from ``req_to_token``; the draft's
multi-step decode steps are planned by ``multistep``.

Attention variants (docs/variants.md): each layer's ``sliding_window_size``,
``logit_cap`` (tanh only), ``attn_type`` (``ENCODER_ONLY``: non-causal) and
``sinks=`` (gpt-oss passes them per call) become the layer's facts, once.
When the adapter is built the model is already loaded, so the adapter walks
its attention layers then (``model_checks``) and refuses, before any batch,
a layer whose variants the backend does not declare. SGLang's hybrid
sliding-window pool (``SWAKVPool``: the window layers' keys in a smaller
pool of their own, ``req_to_token`` naming full-pool slots) is served by a
second attnhost backend for the window layers, over a view whose slot table
is translated into the window pool once per batch: each backend then sees
one KV cache whose ``req_to_token`` is right for every layer it is called
for, as the contract has it.

Cache formats (docs/kv-cache.md): the view reports SGLang's ``--page-size`` as its
``page_size`` (SGLang's paged allocator keeps ``req_to_token`` a list of
slots, page * size + offset, so ``ForwardBatch.page_table`` reads its pages)
and an FP8 pool's float8 dtype (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``),
each layer's scales becoming the layer's ``k_scale`` / ``v_scale``; a backend
that does not declare the format is refused when the adapter is built.

An MLA model's runner gets the subclass in ``mla`` instead (the bridge
picks it), and this class refuses one. What the attnhost contract cannot
express — cross-attention, logit caps other than tanh, a V head dim
unlike the QK one outside MLA, a tree for a backend
without ``tree_mask``, CUDA-graph capture for a backend that does not
declare it — is refused with one error naming the backend and the feature,
at construction or on the first layer or batch that needs it. Never a
wrong number.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as SGLangAttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangForwardMode
from torch import Tensor

from attnhost.backend import AttentionLayer, BackendCapabilities, build_backend, dtype_name
from attnhost.engines.batch_checks import check_device_batch, check_host_lengths
from attnhost.engines.runner_view import RunnerView
from attnhost.engines.sglang.graphs import SEQ_LEN_FILL, DecodeGraphs, VerifyGraphs
from attnhost.engines.sglang.model_checks import attention_layers, dropped_window, model_name, warn_once_per_runner
from attnhost.errors import (
    BackendFailedError,
    InvalidBatchError,
    UnsupportedFeatureError,
    backend_failed,
)
from attnhost.forward_batch import FP8_DTYPES, ForwardBatch, quantize_fp8
from attnhost.forward_mode import ForwardMode

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch

__all__ = ["SGLangAdapterBackend", "UnsupportedFeatureError"]

logger = logging.getLogger("attnhost.engines.sglang")


_MODES = {
    SGLangForwardMode.EXTEND: ForwardMode.EXTEND,
    SGLangForwardMode.MIXED: ForwardMode.MIXED,
    SGLangForwardMode.DECODE: ForwardMode.DECODE,
    SGLangForwardMode.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
    SGLangForwardMode.DRAFT_EXTEND_V2: ForwardMode.DRAFT_EXTEND_V2,
}
_REFUSED_MODES = {
    SGLangForwardMode.SPLIT_PREFILL: "split prefill (PD multiplexing)",
    SGLangForwardMode.DLLM_EXTEND: "diffusion-LLM extend (bidirectional attention)",
    SGLangForwardMode.PREBUILT: "prebuilt (disaggregated decode) batches",
}


ENGINE_BUG = "report this to SGLang's maintainers with the command that produced it"


def host_ints(cpu: Any) -> tuple[int, ...]:
    """One of SGLang's host copies (a CPU tensor or a list) as ints: never a device read."""
    return tuple(int(n) for n in (cpu.tolist() if isinstance(cpu, Tensor) else cpu))


def slot_table(
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    prefix_lens: Tensor,
    prefix_bounds: tuple[int, ...],
    extend_cpu: tuple[int, ...],
    out_cache_loc: Tensor,
) -> Tensor:
    """The key slots of a speculative batch, one row per batch row: its request's first ``prefix_lens`` slots of
    ``req_to_token``, then the slots of its new tokens, which are ``out_cache_loc`` in order.

    SGLang's own backends read a speculative batch's new keys from the write slots (``k``/``v`` of the
    forward), not from ``req_to_token``, which may place them elsewhere (a tree's branches) or not yet at all;
    the contract's backends read every key through ``req_to_token``, so the adapter hands them this table.
    Two rows may name one request (the draft's tree branches share their prefix). The prefixes are the device's
    (``prefix_lens``), placed on the device, so no length is read on the host; the table's width comes from the
    host's bounds of them (``prefix_bounds``). It is built once per batch (a few hundred integers), never per layer.
    """
    width = max(p + e for p, e in zip(prefix_bounds, extend_cpu, strict=True))
    table = req_to_token.new_zeros((len(prefix_bounds), width))
    longest = min(max(prefix_bounds), req_to_token.shape[1])
    if longest:
        table[:, :longest] = req_to_token.index_select(0, req_pool_indices.to(torch.int64))[:, :longest]
    device = req_to_token.device
    # host lists to the device without a blocking copy (a blocking one waits for the stream on a GPU)
    rows = torch.tensor([row for row, e in enumerate(extend_cpu) for _ in range(e)]).to(device, non_blocking=True)
    steps = torch.tensor([j for e in extend_cpu for j in range(e)]).to(device, non_blocking=True)
    cols = prefix_lens.to(device=device, dtype=torch.int64).index_select(0, rows) + steps
    table.index_put_((rows, cols), out_cache_loc.to(device=device, dtype=table.dtype))
    return table


def tree_blocks(custom_mask: Tensor, committed: Tensor, draft_tokens: int) -> tuple[Tensor, Tensor | None]:
    """SGLang's verify ``custom_mask`` as the contract's ``tree_mask``: per request, the
    ``draft_tokens x draft_tokens`` block among the new tokens, concatenated, built on the device from the device's
    committed lengths; with it, for FULL_MASK, the device boolean "the mask's size fits the layout" (else ``None``).

    QLEN_ONLY (where SGLang's ``is_cpu()`` holds) already is that layout: ``draft_tokens**2`` entries a request.
    FULL_MASK (GPU-style platforms) holds, per request, ``draft_tokens`` rows of ``seq_len + draft_tokens``
    entries, the prefix columns first: the block is each row's tail. The size tells the two apart: they coincide
    only for empty prefixes, which a verify never has.
    """
    n, bs = draft_tokens, committed.numel()
    if custom_mask.numel() == bs * n * n:
        return custom_mask.to(torch.bool), None
    seq = committed.to(torch.int64).view(bs, 1, 1)
    rows = (seq + n) * n
    offset = rows.cumsum(0) - rows
    steps = torch.arange(n, device=committed.device)
    index = offset + steps.view(1, n, 1) * (seq + n) + seq + steps.view(1, 1, n)
    fits = rows.sum() == custom_mask.numel()
    index = index.clamp_(0, max(custom_mask.numel() - 1, 0)).view(-1)  # a misfit is refused by ``fits``, not read past
    return custom_mask.to(device=committed.device).index_select(0, index).to(torch.bool), fits


class SGLangKVCache:
    """attnhost's :class:`~attnhost.KVCache` over SGLang's pools: views, never copies.

    ``set_kv`` needs SGLang's ``RadixAttention`` object and the batch's
    physical-id mark, so the adapter records both before each layer runs.
    A speculative batch reads its keys through a slot table of its own
    (``_table``, see :func:`slot_table`), not SGLang's ``req_to_token``.
    """

    __slots__ = ("_fp8", "_layers", "_physical", "_pool", "_req_to_token_pool", "_table", "device", "page_size")

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool: MHATokenToKVPool, device: torch.device) -> None:
        self._req_to_token_pool = req_to_token_pool
        self._pool = token_to_kv_pool
        self._layers: dict[int, RadixAttention] = {}
        self._physical = False
        self._table: torch.Tensor | None = None
        self.device = device
        # SGLang's paged allocator (--page-size) keeps req_to_token a list of slots, slot = page * size + offset,
        # so the page size is all a backend needs to read pages (ForwardBatch.page_table)
        self.page_size = int(getattr(token_to_kv_pool, "page_size", 1) or 1)
        dtype = token_to_kv_pool.dtype
        self._fp8: torch.dtype | None = dtype if dtype in FP8_DTYPES else None

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self._pool.dtype
        return dtype

    @property
    def req_to_token(self) -> torch.Tensor:
        table: torch.Tensor = self._req_to_token_pool.req_to_token if self._table is None else self._table
        return table

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        buffer: torch.Tensor = self._pool.get_key_buffer(layer_id)
        return buffer

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        buffer: torch.Tensor = self._pool.get_value_buffer(layer_id)
        return buffer

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """An FP8 cache gets the contract's write (``quantize_fp8``: divided and saturated, in fresh tensors), which
        SGLang's pool then stores as it is; given the scales, SGLang would divide the caller's ``k`` and ``v`` in
        place (which the backend may still read) and cast without saturating."""
        fp8 = self._fp8
        if fp8 is not None:
            k, v = quantize_fp8(k, k_scale, fp8), quantize_fp8(v, v_scale, fp8)
        self._pool.set_kv_buffer(self._layers[layer_id], self._write_loc(loc), k, v)

    def _write_loc(self, loc: torch.Tensor) -> KVWriteLoc:
        """Where SGLang's pool writes slots ``loc`` (the full pool's own slots)."""
        return KVWriteLoc(loc, physical=self._physical)


class SGLangWindowKVCache(SGLangKVCache):
    """The window layers' side of SGLang's hybrid ``SWAKVPool``: their buffers (the pool's own dispatch by layer)
    and, as ``req_to_token``, the batch's slot table translated into the window pool (:meth:`translate`), with
    the batch's rows in order; slots are window-pool slots throughout, writes included."""

    __slots__ = ()

    def translate(self, table: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``table``'s rows ``rows`` (their first ``width`` slots, full-pool slots) as window-pool slots, kept as
        this view's ``req_to_token``: once per batch, before any layer runs. A slot outside a request's window
        may map to SGLang's dummy slot or to a reused one; a backend that honours the window never reads it."""
        full = table.index_select(0, rows.to(torch.int64))[:, :width]
        translated: torch.Tensor = self._pool.translate_loc_from_full_to_swa(full)
        self._table = translated
        return translated

    def _write_loc(self, loc: torch.Tensor) -> KVWriteLoc:
        """The slots are already window-pool slots: SGLang's pool must not translate them again."""
        return KVWriteLoc(loc, swa_loc=loc, physical=self._physical)


class _Stamp:
    """A backend-name stamp SGLang writes on the adapter, written through to the attnhost backend inside."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, adapter: object, owner: type | None = None) -> str | None:
        return None if adapter is None else adapter.__dict__.get(self.name)

    def __set__(self, adapter: object, value: str | None) -> None:
        adapter.__dict__[self.name] = value
        for inner in (adapter.__dict__.get("attnhost_backend"), adapter.__dict__.get("window_backend")):
            if inner is not None:
                setattr(inner, self.name, value)


def _no_peers(needs: tuple[str, ...]) -> list[str]:
    """No other backend to suggest: an adapter built outside the bridge knows of no peers."""
    return []


class SGLangAdapterBackend(SGLangAttentionBackend):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's backend interface over one attnhost backend, built once per SGLang model runner."""

    def __init__(
        self,
        model_runner: Any,
        *,
        engine_name: str,
        attnhost_name: str,
        origin: str,
        factory: Any,
        capabilities: BackendCapabilities,
        capable_peers: Callable[[tuple[str, ...]], list[str]] = _no_peers,
    ) -> None:
        super().__init__()
        self._capable_peers = capable_peers
        self.engine_name = engine_name
        self.attnhost_name = attnhost_name
        self.origin = origin
        self.capabilities = capabilities
        self.device = torch.device(model_runner.device)
        # The flag that chose this backend, for every way out a refusal names: a draft's is its own.
        self.flag = (
            "--speculative-draft-attention-backend"
            if getattr(model_runner, "is_draft_worker", False)
            else "--attention-backend"
        )
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self._check_runner(model_runner)
        self.data_type = getattr(model_runner, "dtype", None) or self.token_to_kv_pool.dtype
        self.kv_cache_dtype = self.token_to_kv_pool.dtype
        self._kv = SGLangKVCache(self.req_to_token_pool, self.token_to_kv_pool, self.device)
        self._num_slots = self._slots_per_layer()
        is_draft = bool(getattr(model_runner, "is_draft_worker", False))
        view = RunnerView(self.device, self.data_type, is_draft, self._kv)
        self.attnhost_backend = self._build(factory, view)
        # SGLang's hybrid pool: the window layers run on a backend of their own, over the window pool's view
        self._window_kv: SGLangWindowKVCache | None = None
        self.window_backend = None
        self._window_ids: frozenset[int] = frozenset()
        if isinstance(self.token_to_kv_pool, SWAKVPool):
            self._window_kv = SGLangWindowKVCache(self.req_to_token_pool, self.token_to_kv_pool, self.device)
            mapping = self.token_to_kv_pool.layers_mapping
            self._window_ids = frozenset(layer_id for layer_id, (_, swa) in mapping.items() if swa)
            window_view = RunnerView(self.device, self.data_type, is_draft, self._window_kv)
            self.window_backend = self._build(factory, window_view)
        self._window_batch: ForwardBatch | None = None
        self._layers: dict[int, AttentionLayer] = {}
        self._sinks: dict[int, tuple[Tensor, int, Tensor]] = {}  # layer -> (SGLang's sinks, their version, passed)
        self._sglang_batch: SGLangBatch | None = None
        self._batch: ForwardBatch | None = None
        self._decode: bool | None = None  # the planned batch's method (see forward); None: SGLang's own dispatch
        self._graphs: DecodeGraphs | None = None  # SGLang's decode graphs, once a graph runner asks (graphs.py)
        self._verify_graphs: VerifyGraphs | None = None  # and its target-verify graphs, at their first capture
        self._cpu_graphs = False  # the CPU graph runner's: it plans every decode batch it runs eagerly
        if not getattr(model_runner, "use_mla_backend", False):
            self._check_model(model_runner)

    def _build(self, factory: Any, view: RunnerView) -> Any:
        return build_backend(
            factory,
            view,
            where=self._where,
            way_out=f"fix or reinstall the plugin, or choose another {self.flag}",
            owner=self.origin,
        )

    def _slots_per_layer(self) -> int:
        """How many slots ``out_cache_loc`` may name: a layer's buffer rows, the full pool's in a hybrid pool."""
        pool = self.token_to_kv_pool
        if isinstance(pool, SWAKVPool):
            return int(pool.full_kv_pool.k_buffer[0].shape[0])
        first_layer = getattr(pool, "start_layer", 0) or 0  # pipeline stages start further on
        return int(pool.get_key_buffer(first_layer).shape[0])  # as many in every layer

    def _check_model(self, runner: Any) -> None:
        """Convert every attention layer of the loaded model now and refuse, before any batch, one whose variants
        the backend does not declare (``BackendCapabilities.layer_refusal``); warn once if the config declares a
        window no layer carries (Mistral v0.1, Qwen2: SGLang's model code drops it)."""
        model = getattr(runner, "model", None)
        if model is None:
            return
        windows = []
        for radix, has_sinks in attention_layers(model):
            layer = self._layer(radix, has_sinks, walked=True)
            windows.append(layer.sliding_window_size)
            reason = self.capabilities.layer_refusal(layer)
            if reason is not None:
                raise UnsupportedFeatureError(
                    f"{self._where} cannot serve {model_name(runner)}: layer {layer.layer_id} needs {reason}; "
                    f"{self._variant_way_out(layer.variant_features)}"
                )
            if layer.layer_id in self._window_ids and layer.sliding_window_size < 0:
                raise self.refusal(
                    f"layer {layer.layer_id} of {model_name(runner)} without a window although SGLang keeps its "
                    "keys in the hybrid pool's window part",
                    "run SGLang with --disable-hybrid-swa-memory",
                )
        warning = dropped_window(runner, windows)
        if warning is not None and warn_once_per_runner(runner):
            logger.warning("%s", warning)

    def _variant_way_out(self, needs: tuple[str, ...]) -> str:
        """The way out of a variant refusal: the exported attnhost backends that declare all of *needs*."""
        capable = [name for name in self._capable_peers(needs) if name != self.engine_name]
        flags = ", ".join(needs)
        if capable:
            return f"choose with {self.flag} a backend that declares {flags}, e.g. {', '.join(capable)}"
        return f"choose with {self.flag} a backend that declares {flags}"

    @property
    def _where(self) -> str:
        return f"attnhost backend {self.attnhost_name!r} ({self.origin}), SGLang {self.flag} {self.engine_name!r}"

    def refusal(self, feature: str, way_out: str | None = None) -> UnsupportedFeatureError:
        return UnsupportedFeatureError(
            f"{self._where} does not support {feature}; {way_out or 'choose another ' + self.flag}"
        )

    # SGLang stamps the runner's resolved names on its backend after building it; the
    # attnhost backend inside carries the same stamps, so attnhost-side dispatch agrees with SGLang's.
    prefill_attention_backend_str = _Stamp()
    decode_attention_backend_str = _Stamp()

    # -- construction-time checks -----------------------------------------------------

    def _check_runner(self, runner: Any) -> None:
        if getattr(runner, "use_mla_backend", False):
            raise self.refusal("MLA models (multi-head latent attention)")
        model_config = getattr(runner, "model_config", None)
        if getattr(model_config, "is_encoder_decoder", False):
            raise self.refusal("encoder-decoder models (cross-attention)")
        pool = self.token_to_kv_pool
        pools = [pool]
        if isinstance(pool, SWAKVPool):  # SGLang's hybrid pool: the window layers' keys in a pool of their own
            if getattr(getattr(runner, "kv_index_translator", None), "is_translating", False):
                raise self.refusal(
                    "SGLang's unified memory pool (its req_to_token holds virtual KV ids)",
                    "run SGLang without --enable-unified-memory",
                )
            if not pool.full_layer_nums:
                raise self.refusal("a hybrid KV pool without full-attention layers", "use --disable-hybrid-swa-memory")
            pools = [pool.full_kv_pool, pool.swa_kv_pool]
        if getattr(runner, "is_hybrid_swa", False) and not self.capabilities.sliding_window:
            # SGLang's own start-up word that the model has window layers: refused before any layer is walked
            raise self.refusal(
                f"sliding-window attention, which {model_name(runner)} needs (SGLang's is_hybrid_swa; it does not "
                "declare sliding_window)",
                self._variant_way_out(("sliding_window",)),
            )
        for part in pools:
            self._check_pool(runner, part)

    def _check_pool(self, runner: Any, pool: Any) -> None:
        if not isinstance(pool, MHATokenToKVPool):
            raise self.refusal(f"SGLang's {type(pool).__name__} (it reads MHATokenToKVPool)")
        if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", None) not in (None, "NHD", "nhd"):
            raise self.refusal("a head-major (HND) KV-cache layout", "unset SGLANG_USE_HND_KVCACHE")
        if getattr(pool, "is_quantized_kv_cache", False):
            raise self.refusal(
                f"SGLang's block-quantized KV cache ({type(getattr(pool, 'quant_method', None)).__name__})",
                "use --kv-cache-dtype auto, fp8_e4m3 or fp8_e5m2",
            )
        if pool.v_head_dim != pool.head_dim:
            raise self.refusal(f"a V head dim ({pool.v_head_dim}) unlike the QK head dim ({pool.head_dim})")
        model_dtype = dtype_name(getattr(runner, "dtype", pool.dtype))
        reason = self.capabilities.refusal(dtype=model_dtype, head_dim=pool.head_dim)
        if reason is not None:
            raise self.refusal(reason, f"choose another --dtype or {self.flag}")
        self._check_cache(pool)

    def _check_cache(self, pool: Any) -> None:
        """Refuse a cache format the backend does not declare (``BackendCapabilities.cache_refusal``): an FP8 one
        (SGLang's ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``, stored through a ``uint8`` view) or a page size
        (``--page-size``); any other stored form is no format of the contract."""
        dtype, store = pool.dtype, getattr(pool, "store_dtype", pool.dtype)
        if store != dtype and not (dtype in FP8_DTYPES and store == torch.uint8):
            raise self.refusal(
                f"a KV cache of dtype {dtype_name(dtype)} stored as {dtype_name(store)}", "use --kv-cache-dtype auto"
            )
        page_size = int(getattr(pool, "page_size", 1) or 1)
        reason = self.capabilities.cache_refusal(kv_dtype=dtype_name(dtype), page_size=page_size)
        if reason is not None:
            raise self.refusal(
                reason,
                f"run SGLang with a --kv-cache-dtype and --page-size it declares (this cache: {dtype_name(dtype)} in "
                f"pages of {page_size}), or choose with {self.flag} a backend that declares them (e.g. "
                "attnhost_torch_native)",
            )

    def _layer(self, layer: RadixAttention, has_sinks: bool = False, *, walked: bool = False) -> AttentionLayer:
        """The attnhost view of a layer, checked once: for every layer of the model when the adapter is built
        (``_check_model``), else on its first forward (a layer the walk did not find: ``has_sinks`` is then
        whether that call passed ``sinks=``)."""
        if getattr(layer, "is_cross_attention", False):
            raise self.refusal(f"cross-attention (layer {layer.layer_id})")
        attn_type = getattr(getattr(layer, "attn_type", None), "name", "DECODER")
        if attn_type not in ("DECODER", "ENCODER_ONLY"):
            raise self.refusal(f"{attn_type.lower()} attention (layer {layer.layer_id})")
        cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
        method = getattr(layer, "logit_capping_method", "tanh")
        if cap > 0 and method != "tanh":
            raise self.refusal(
                f"the logit-capping method {method!r} (layer {layer.layer_id}; the contract's soft-cap is tanh)"
            )
        if layer.qk_head_dim != layer.v_head_dim:
            raise self.refusal(f"a V head dim ({layer.v_head_dim}) unlike the QK head dim ({layer.qk_head_dim})")
        head_dim = layer.qk_head_dim
        reason = self.capabilities.refusal(dtype=dtype_name(self.data_type), head_dim=head_dim)
        if reason is not None:
            raise self.refusal(reason)
        window = getattr(layer, "sliding_window_size", -1)
        converted = AttentionLayer(
            layer_id=layer.layer_id,
            num_heads=layer.tp_q_head_num,
            num_kv_heads=layer.tp_k_head_num,
            head_dim=head_dim,
            scaling=float(layer.scaling),
            sliding_window_size=-1 if window is None or window < 0 else int(window),
            logit_cap=cap,
            has_sinks=has_sinks,
            is_causal=attn_type == "DECODER",
            k_scale=self._scale(layer, "k"),
            v_scale=self._scale(layer, "v"),
        )
        reason = None if walked else self.capabilities.layer_refusal(converted)
        if reason is not None:  # the start-up walk refuses these naming the model; a layer it did not find, here
            raise self.refusal(f"{reason} (layer {layer.layer_id})", self._variant_way_out(converted.variant_features))
        self._layers[layer.layer_id] = converted
        view = self._window_kv if layer.layer_id in self._window_ids and self._window_kv is not None else self._kv
        view._layers[layer.layer_id] = layer
        return converted

    def _scale(self, layer: RadixAttention, which: str) -> float:
        """The layer's K or V scale as a float (the contract's ``AttentionLayer.k_scale`` / ``v_scale``): SGLang's
        ``k_scale_float`` once its weights are loaded, else its one-element ``k_scale``; none is 1.0. A float cache
        ignores it; a per-head scale is no scale the contract knows, so it is refused."""
        value = getattr(layer, f"{which}_scale_float", None)
        if value is None:
            scale = getattr(layer, f"{which}_scale", None)
            if scale is None:
                return 1.0
            if isinstance(scale, torch.Tensor):
                if scale.numel() != 1:
                    raise self.refusal(
                        f"a {which.upper()} scale of {scale.numel()} entries (layer {layer.layer_id}; the contract's "
                        "scale is one per layer)",
                        "use --kv-cache-dtype auto",
                    )
                return float(scale.item())
            value = scale
        return float(value)

    # -- per batch ------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: SGLangBatch) -> None:
        """Translate SGLang's batch once, checked without a host sync (see ``batch_checks``), then let the attnhost
        backend plan it."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self._plan(forward_batch, None)
            return
        attnhost_mode = _MODES.get(mode)
        if attnhost_mode is None:
            raise self.refusal(_REFUSED_MODES.get(mode, f"forward mode {mode.name}"))
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise self.refusal("encoder tokens in the batch (cross-attention)")
        spec_info = forward_batch.spec_info
        if attnhost_mode is not ForwardMode.TARGET_VERIFY and getattr(spec_info, "custom_mask", None) is not None:
            raise self.refusal(f"custom attention masks in a {mode.name} batch (only target-verify carries a tree)")
        if attnhost_mode is ForwardMode.DECODE and getattr(spec_info, "topk", 1) > 1:
            # the draft's branch rows need the multi-step container
            raise self.refusal("speculative draft decode over tree branches outside its multi-step container")
        self._kv._physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))
        graphs = self._graphs if self._cpu_graphs and attnhost_mode is ForwardMode.DECODE else None
        if graphs is not None and graphs.covers(forward_batch.batch_size):  # the CPU graph runner runs it compiled
            self._kv._table = None
            self._plan(forward_batch, graphs.refresh(self._where, forward_batch, self._num_slots, ENGINE_BUG))
            return
        if attnhost_mode is ForwardMode.TARGET_VERIFY:
            batch = self._verify_batch(forward_batch, spec_info)
        else:
            batch = self._extend_or_decode_batch(forward_batch, attnhost_mode)
        self._plan(forward_batch, batch)

    def _extend_or_decode_batch(self, forward_batch: SGLangBatch, mode: ForwardMode) -> ForwardBatch:
        """EXTEND, MIXED, DECODE and DRAFT_EXTEND_V2, on the scheduler's host copies of the lengths (exact for
        these batches: SGLang's own kernels plan from them), checked against the device's on the device. A decode
        batch without a host copy is a captured graph's (SGLang's graph runners keep the lengths on the device
        only): its host lengths are the request table's width, as bounds."""
        seq_lens = forward_batch.seq_lens
        exact = True
        if mode is ForwardMode.DECODE:
            host = forward_batch.seq_lens_cpu
            if host is None:
                exact = False
                seq_cpu = (self._table_shape[1],) * forward_batch.batch_size
            else:
                seq_cpu = host_ints(host)
            prefix_lens = seq_lens - 1
            extend_lens = torch.ones_like(seq_lens)
            prefix_cpu = tuple(n - 1 for n in seq_cpu)
            extend_cpu = (1,) * len(seq_cpu)
        else:
            prefix_lens = forward_batch.extend_prefix_lens
            extend_lens = forward_batch.extend_seq_lens
            prefix_cpu = host_ints(forward_batch.extend_prefix_lens_cpu)
            extend_cpu = host_ints(forward_batch.extend_seq_lens_cpu)
            seq_cpu = tuple(p + e for p, e in zip(prefix_cpu, extend_cpu, strict=True))
        self._check(forward_batch, seq_lens, prefix_cpu, extend_cpu, exact, extend_cpu)
        if mode is ForwardMode.DRAFT_EXTEND_V2:
            # seq_lens already count the new tokens; they attend causally to the prefix and to each other, read
            # through a table of their own (the slots SGLang writes them to now), as SGLang's backends do.
            return self._spec_batch(mode, forward_batch, seq_lens - extend_lens, prefix_cpu, extend_cpu, None, exact)
        self._kv._table = None
        return self._batch_of(
            forward_mode=mode,
            kv_pool=self._kv,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens,
            out_cache_loc=forward_batch.out_cache_loc,
            seq_lens_cpu=seq_cpu,
            prefix_lens_cpu=prefix_cpu,
            extend_seq_lens_cpu=extend_cpu,
            host_lengths_exact=exact,
        )

    @property
    def _table_shape(self) -> tuple[int, int]:
        rows, width = self._kv._req_to_token_pool.req_to_token.shape
        return int(rows), int(width)

    def _check(
        self,
        forward_batch: SGLangBatch,
        device_lens: Tensor,
        prefix_cpu: tuple[int, ...],
        extend_cpu: tuple[int, ...],
        exact: bool,
        least: tuple[int, ...],
        write_slots: Tensor | None = None,
    ) -> None:
        """The batch's host lengths on the host, its slots, rows and ``device_lens`` on the device, without a read
        (``batch_checks``). ``device_lens`` are SGLang's ``seq_lens``: ``prefix + extend`` for an extend or a decode
        (equal to the host's where ``exact``, else within them and at least ``least``), the committed prefix for a
        verify or a draft round (within ``prefix_cpu``, the host's bounds). ``write_slots``: the slots a draft round
        writes, where ``out_cache_loc`` holds a wider window than its steps. (A graph batch, whose padded rows all
        write SGLang's slot 0, is checked by ``graphs.DecodeGraphs.refresh``.)"""
        loc = forward_batch.out_cache_loc if write_slots is None else write_slots
        shape = self._table_shape
        count = loc.numel() if write_slots is None else sum(extend_cpu)
        check_host_lengths(self._where, prefix_cpu, extend_cpu, shape, count, ENGINE_BUG)
        committed = forward_batch.forward_mode.is_target_verify() or write_slots is not None
        check_device_batch(
            self._where,
            seq_lens=device_lens,
            out_cache_loc=loc,
            req_pool_indices=forward_batch.req_pool_indices,
            host_seq_lens=prefix_cpu
            if committed
            else tuple(p + e for p, e in zip(prefix_cpu, extend_cpu, strict=True)),
            host_lengths_exact=exact,
            extend_lens=least,
            num_slots=self._num_slots,
            num_rows=shape[0],
            way_out=ENGINE_BUG,
        )

    def _batch_of(self, **fields: Any) -> ForwardBatch:
        """An attnhost batch, its own consistency refusals (``ForwardBatch``) named as this backend's."""
        try:
            return ForwardBatch(**fields)
        except ValueError as exc:
            raise InvalidBatchError(f"{self._where}: {exc}; nothing was read or written — {ENGINE_BUG}") from None

    def _plan(self, forward_batch: SGLangBatch, batch: ForwardBatch | None) -> None:
        """Remember the batch SGLang planned and let the attnhost backend plan its translation."""
        self._sglang_batch = forward_batch
        self._batch = self._window_batch = None  # a refused or failed plan leaves no batch behind to run layers on
        if batch is not None and not self.capabilities.cuda_graph:
            # the backend plans from exact host lengths: where the engine has only bounds, one read on its behalf
            batch = batch.with_exact_host_lengths()
        window_batch = None if batch is None or self._window_kv is None else self._window_twin(batch)
        for backend, planned in ((self.attnhost_backend, batch), (self.window_backend, window_batch)):
            if planned is not None and backend is not None:
                try:
                    backend.init_forward_metadata(planned)
                except (Exception, SystemExit) as exc:
                    raise self.failure("init_forward_metadata", planned.forward_mode, None, exc) from exc
        self._batch, self._window_batch = batch, window_batch
        mode = forward_batch.forward_mode
        self._decode = None if batch is None or mode.is_mixed() else mode.is_decode()

    def _window_twin(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch as the window layers' backend sees it: the same lengths over the hybrid pool's window part,
        each row's slots (and the write slots) translated from the full pool once, here, for every layer."""
        window_kv = self._window_kv
        assert window_kv is not None
        window_kv._physical = self._kv._physical
        width = max(batch.seq_lens_cpu)
        window_kv.translate(batch.kv_pool.req_to_token, batch.req_pool_indices, width)
        rows = torch.arange(batch.batch_size, dtype=torch.int64, device=batch.req_pool_indices.device)
        loc = self.token_to_kv_pool.translate_loc_from_full_to_swa(batch.out_cache_loc)
        return replace(batch, kv_pool=window_kv, req_pool_indices=rows, out_cache_loc=loc)

    def failure(self, method: str, mode: ForwardMode, layer_id: int | None, exc: BaseException) -> BackendFailedError:
        return backend_failed(self._where, self.origin, method, mode.name, layer_id, exc)

    def _verify_batch(self, forward_batch: SGLangBatch, spec_info: Any) -> ForwardBatch:
        """TARGET_VERIFY: each request's ``draft_token_num`` new tokens after its committed ``seq_lens``.

        The committed lengths are the device's, placed on the device and never read on the host: a speculative
        worker's host copy may be only a planning bound (DFLASH sets it to the committed length plus the block
        size), and attending to that many slots reads slots that hold nothing yet. The host copy (or, without
        one, the request table's width) becomes the batch's host bounds. Whether the new tokens form a chain or a
        tree is read from the mask the batch carries, never from an attribute some verify inputs lack (NGRAM's
        has no ``topk``): no ``custom_mask``, or one that is causal among the new tokens, is a chain; anything
        else a tree, for which SGLang's FULL_MASK (per request, ``draft_token_num`` rows of ``seq_len +
        draft_token_num`` booleans, GPU-style platforms) and QLEN_ONLY (``draft_token_num**2`` per request, where
        SGLang's ``is_cpu()`` holds) layouts both become the contract's per-request ``tree_mask`` blocks.
        """
        draft_tokens = int(getattr(spec_info, "draft_token_num", 0) or 0)
        if draft_tokens < 1:
            raise self.refusal("a target-verify batch without draft_token_num (not an EAGLE verify input)")
        bs = forward_batch.batch_size
        most = self._table_shape[1] - draft_tokens  # the longest committed prefix the table leaves room for
        host = forward_batch.seq_lens_cpu
        bounds = (most,) * bs if host is None else tuple(min(n, most) for n in host_ints(host))
        extend = (draft_tokens,) * bs
        self._check(forward_batch, forward_batch.seq_lens, bounds, extend, False, (0,) * bs)
        tree_mask = self._tree_mask(getattr(spec_info, "custom_mask", None), forward_batch.seq_lens, spec_info)
        if tree_mask is not None and not self.capabilities.tree_mask:
            raise self.refusal(
                "speculative tree verify (this batch's custom_mask is a tree; it declares no tree_mask capability)",
                "run chains (--speculative-eagle-topk 1) or choose a backend that declares tree_mask",
            )
        return self._spec_batch(
            ForwardMode.TARGET_VERIFY, forward_batch, forward_batch.seq_lens, bounds, extend, tree_mask, False
        )

    def _tree_mask(self, custom_mask: Tensor | None, committed: Tensor, spec_info: Any) -> Tensor | None:
        """The verify batch's tree as the contract's blocks, or ``None`` for a chain: no mask, or an EAGLE chain
        (``topk == 1``), whose mask is causal. Without that word (NGRAM's and DFLASH's inputs have no ``topk``) a
        backend that declares ``tree_mask`` gets the mask whatever it holds (a causal one is a chain); for one that
        does not, whether it is causal is read from the mask, on its behalf."""
        if custom_mask is None:
            return None
        draft_tokens = int(spec_info.draft_token_num)
        blocks = self._blocks(custom_mask, committed, draft_tokens)
        topk = getattr(spec_info, "topk", None)
        if topk == 1:
            return None
        if topk is not None or self.capabilities.tree_mask:
            return blocks
        causal = torch.ones(draft_tokens, draft_tokens, dtype=torch.bool, device=blocks.device).tril_()
        if torch.equal(blocks.view(-1, draft_tokens, draft_tokens), causal.expand(committed.numel(), -1, -1)):
            return None
        return blocks

    def _blocks(self, custom_mask: Tensor, committed: Tensor, draft_tokens: int) -> Tensor:
        """SGLang's verify mask as the contract's blocks (``tree_blocks``), refused where it is no bool mask or fits
        no layout SGLang makes (checked on the device: no read unless it fails)."""
        if custom_mask.dtype != torch.bool or custom_mask.dim() != 1:
            raise InvalidBatchError(
                f"{self._where}: this verify batch's custom_mask is a {custom_mask.dim()}-D {custom_mask.dtype} "
                "tensor; SGLang's verify masks are flat bool tensors (True: the token may attend), and an additive "
                f"float mask read as booleans would invert it; nothing was read or written — {ENGINE_BUG}"
            )
        blocks, fits = tree_blocks(custom_mask, committed, draft_tokens)
        if fits is not None:
            try:
                torch._assert_async(fits, f"{self._where}: a verify custom_mask fits no layout SGLang makes")
            except RuntimeError:
                raise InvalidBatchError(
                    f"{self._where}: this verify batch's custom_mask ({custom_mask.numel()} entries) fits neither "
                    f"SGLang's QLEN_ONLY nor its FULL_MASK layout for {committed.numel()} requests of {draft_tokens} "
                    f"draft tokens (draft_token_num); nothing was read or written — {ENGINE_BUG}"
                ) from None
        return blocks

    def plan_draft_step(
        self,
        forward_batch: SGLangBatch,
        table: Tensor,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        out_cache_loc: Tensor,
        step: int,
    ) -> None:
        """Draft decode step ``step`` of a multi-step round (``multistep.SGLangMultiStepDraftBackend``): row ``r``
        of ``table`` has its prefix and branch slots, and reads its first ``prefix_lens[r] + step + 1`` (the
        device's prefix, within the host's ``prefix_bounds``)."""
        self._kv._table = table
        self._kv._physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))
        bounds = tuple(p + step for p in prefix_bounds)
        self._plan(
            forward_batch,
            self._table_batch(
                ForwardMode.DECODE, prefix_lens + step, bounds, (1,) * len(bounds), out_cache_loc, None, False
            ),
        )

    def _spec_batch(
        self,
        mode: ForwardMode,
        forward_batch: SGLangBatch,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        extend_cpu: tuple[int, ...],
        tree_mask: Tensor | None,
        exact: bool,
    ) -> ForwardBatch:
        """A speculative batch over its own slot table (see :func:`slot_table`): row ``i`` is request ``i``."""
        out_cache_loc = forward_batch.out_cache_loc
        table = self._kv._req_to_token_pool.req_to_token
        self._kv._table = slot_table(
            table, forward_batch.req_pool_indices, prefix_lens, prefix_bounds, extend_cpu, out_cache_loc
        )
        return self._table_batch(mode, prefix_lens, prefix_bounds, extend_cpu, out_cache_loc, tree_mask, exact)

    def _table_batch(
        self,
        mode: ForwardMode,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        extend_cpu: tuple[int, ...],
        out_cache_loc: Tensor,
        tree_mask: Tensor | None,
        exact: bool,
    ) -> ForwardBatch:
        """A batch whose row ``i`` is row ``i`` of the view's slot table, its lengths the device's ``prefix_lens``
        plus the host's exact ``extend_cpu`` (host lengths: ``prefix_bounds``, exact or bounds)."""
        device = prefix_lens.device
        prefix = prefix_lens.to(torch.int64)
        extend = torch.tensor(extend_cpu, dtype=torch.int64).to(device, non_blocking=True)
        return self._batch_of(
            forward_mode=mode,
            kv_pool=self._kv,
            req_pool_indices=torch.arange(len(prefix_bounds), dtype=torch.int64, device=device),
            seq_lens=prefix + extend,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            out_cache_loc=out_cache_loc.to(torch.int64),
            seq_lens_cpu=tuple(p + e for p, e in zip(prefix_bounds, extend_cpu, strict=True)),
            prefix_lens_cpu=prefix_bounds,
            extend_seq_lens_cpu=extend_cpu,
            tree_mask=tree_mask,
            host_lengths_exact=exact,
        )

    # -- per layer ------------------------------------------------------------------

    def forward(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        """SGLang's own dispatch (idle, decode, extend), decided once per batch in ``_plan`` instead of by two
        mode tests in every layer's call: with the layer's code cold, as a real layer's is after the MLP has
        streamed its weights, those tests took 26 us, against 450 us for a whole one-request 4,096-token decode
        on a compiled kernel (BENCHMARKS.md, "Compiled CPU kernel")."""
        decode = self._decode
        if decode is None or forward_batch is not self._sglang_batch:
            out: Tensor = super().forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            return out
        if decode:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    # SGLang calls these two by name (and plugins may hook them by name), so both stay real methods.
    def forward_extend(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        return self._run("forward_extend", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        return self._run("forward_decode", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _run(
        self,
        method: str,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool,
        kwargs: dict[str, Any],
    ) -> Tensor:
        batch = self._batch
        if batch is None or (forward_batch is not self._sglang_batch and not self._same_batch(batch, forward_batch)):
            raise RuntimeError(f"{self._where}: init_forward_metadata() was not called for this ForwardBatch")
        sinks = None
        if kwargs:
            sinks = kwargs.pop("sinks", None)
            if kwargs and any(value is not None for value in kwargs.values()):
                extra = ", ".join(sorted(name for name, value in kwargs.items() if value is not None))
                raise self.refusal(f"the extra attention arguments {extra} (layer {layer.layer_id})")
        attnhost_layer = self._layers.get(layer.layer_id) or self._layer(layer, sinks is not None)
        backend = self.attnhost_backend
        if self._window_batch is not None and layer.layer_id in self._window_ids:  # the hybrid pool's window part
            backend, batch = self.window_backend, self._window_batch
        tokens = q.shape[0]
        if tokens != batch.num_new_tokens:
            raise self.refusal(f"padded batches ({tokens} query rows for {batch.num_new_tokens} tokens)")
        if save_kv_cache and (k is None or v is None):
            raise RuntimeError(f"{self._where}: save_kv_cache=True but SGLang passed no K/V for layer {layer.layer_id}")
        if k is not None and k.dim() != 3:  # RadixAttention already hands [tokens, kv_heads, head_dim]
            k = k.view(-1, attnhost_layer.num_kv_heads, attnhost_layer.head_dim)
        if v is not None and v.dim() != 3:
            v = v.view(-1, attnhost_layer.num_kv_heads, attnhost_layer.head_dim)
        forward = getattr(backend, method)
        if sinks is not None or attnhost_layer.has_sinks:
            return self._run_with_sinks(forward, method, q, k, v, attnhost_layer, batch, save_kv_cache, sinks)
        if self.capabilities.flat_heads and q.dim() == 2:  # SGLang's [tokens, heads * dim] both ways: no views
            try:  # free when nothing raises; a plugin's exception gets the one line naming it
                out: Tensor = forward(q, k, v, attnhost_layer, batch, save_kv_cache)
            except (Exception, SystemExit) as exc:
                raise self.failure(method, batch.forward_mode, layer.layer_id, exc) from exc
            return self._flat(out, q)
        q3 = q.view(tokens, attnhost_layer.num_heads, attnhost_layer.head_dim)
        try:
            out = forward(q3, k, v, attnhost_layer, batch, save_kv_cache)
        except (Exception, SystemExit) as exc:
            raise self.failure(method, batch.forward_mode, layer.layer_id, exc) from exc
        return out.reshape(tokens, -1)

    def _flat(self, out: Tensor, q: Tensor) -> Tensor:
        if out.dim() != 2:
            raise RuntimeError(
                f"{self._where} declares flat_heads but returned shape {tuple(out.shape)} for a "
                f"[{q.shape[0]}, {q.shape[1]}] query; fix the plugin (the conformance kit checks this)"
            )
        return out

    def _run_with_sinks(
        self,
        forward: Any,
        method: str,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: AttentionLayer,
        batch: ForwardBatch,
        save_kv_cache: bool,
        sinks: Tensor | None,
    ) -> Tensor:
        """A layer with sinks (``has_sinks``): ``sinks=`` on to the backend, as the contract has them."""
        if sinks is None or not layer.has_sinks:
            raise InvalidBatchError(
                f"{self._where}: layer {layer.layer_id} was called "
                + (
                    "without sinks= although its attention module holds sinks"
                    if sinks is None
                    else "with sinks= although its attention module holds none"
                )
                + f"; nothing was read or written — {ENGINE_BUG}"
            )
        passed = self._sinks_for(layer, sinks)
        tokens = q.shape[0]
        try:
            if self.capabilities.flat_heads and q.dim() == 2:
                return self._flat(forward(q, k, v, layer, batch, save_kv_cache, sinks=passed), q)
            q3 = q.view(tokens, layer.num_heads, layer.head_dim)
            out: Tensor = forward(q3, k, v, layer, batch, save_kv_cache, sinks=passed)
        except (Exception, SystemExit) as exc:
            raise self.failure(method, batch.forward_mode, layer.layer_id, exc) from exc
        return out.reshape(tokens, -1)

    def _sinks_for(self, layer: AttentionLayer, sinks: Tensor) -> Tensor:
        """SGLang's sinks as the contract takes them: ``[num_heads]`` in the layer's dtype or float32. gpt-oss keeps
        them in bfloat16 whatever the model's dtype, so those become float32, once per weight version (an in-place
        weight update bumps the tensor's version), not on every call."""
        cached = self._sinks.get(layer.layer_id)
        if cached is not None and cached[0] is sinks and cached[1] == sinks._version:
            return cached[2]
        if tuple(sinks.shape) != (layer.num_heads,):
            raise InvalidBatchError(
                f"{self._where}: layer {layer.layer_id} was passed sinks of shape {tuple(sinks.shape)}, not one per "
                f"query head of this rank ({layer.num_heads},); nothing was read or written — {ENGINE_BUG}"
            )
        passed = sinks if sinks.dtype in (self.data_type, torch.float32) else sinks.to(torch.float32)
        self._sinks[layer.layer_id] = (sinks, sinks._version, passed)
        return passed

    def _same_batch(self, batch: ForwardBatch, forward_batch: SGLangBatch) -> bool:
        """Whether another ForwardBatch object describes the batch planned: SGLang's eager runner copies a
        pre-planned batch (draft steps, verify, draft-extend) into its static buffers and runs the layers on
        the copy. Same mode and the same write slots; checked once, then the copy is the planned batch."""
        planned, loc = self._sglang_batch, forward_batch.out_cache_loc
        if planned is None or loc is None or forward_batch.forward_mode != planned.forward_mode:
            return False
        if loc.shape != batch.out_cache_loc.shape or not torch.equal(loc.to(torch.int64), batch.out_cache_loc):
            return False
        self._sglang_batch = forward_batch
        return True

    # -- graphs (graphs.py, docs/graphs.md) -------------------------------------------

    def graph_refusal(self) -> UnsupportedFeatureError:
        return self.refusal(
            "graph capture (it declares no cuda_graph capability)", "run SGLang with --disable-cuda-graph"
        )

    def start_graphs(self, max_bs: int, max_num_tokens: int) -> None:
        """Refuse graphs this adapter cannot capture, at start-up, and let the backend allocate the buffers its
        graph steps refresh in place (``AttentionBackend.init_graph_state``)."""
        if not self.capabilities.cuda_graph:
            raise self.graph_refusal()
        if self.window_backend is not None:
            raise self.refusal(
                "graph capture over SGLang's hybrid window pool (its window slots are translated per batch)",
                "run SGLang with --disable-cuda-graph or --disable-hybrid-swa-memory",
            )
        try:
            self.attnhost_backend.init_graph_state(max_bs, max_num_tokens, self._table_shape[1])
        except (Exception, SystemExit) as exc:
            raise self.failure("init_graph_state", ForwardMode.DECODE, None, exc) from exc

    def _init_graphs(self, max_bs: int, max_num_tokens: int, cpu: bool) -> None:
        """Allocate the graphs' buffers once, for the largest captured batch: the decode graphs' now, a verify
        graph's at its first capture (its draft-token count comes with the batch)."""
        self.start_graphs(max_bs, max(max_bs, max_num_tokens))
        self._graphs = DecodeGraphs(self._kv, max_bs, self._table_shape, self.device)
        self._verify_graphs = None
        self._cpu_graphs = cpu

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._init_graphs(max_bs, max_num_tokens, cpu=False)

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._init_graphs(max_bs, max_num_tokens, cpu=True)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        if not self.capabilities.cuda_graph:
            raise self.graph_refusal()
        return SEQ_LEN_FILL

    get_cpu_graph_seq_len_fill_value = get_cuda_graph_seq_len_fill_value

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """The host part of a graph step, before capture and before every replay: SGLang's batch (or its replay
        view) into the graph's buffers, checked, and the backend's plan of the same batch object, in place. The
        graph itself then holds only the layers' forward (``init_forward_metadata_in_graph`` has nothing left).
        Decode and target-verify graphs (``DecodeCudaGraphRunner`` captures one or the other)."""
        graphs = self._graphs
        if graphs is None:
            raise (
                self.graph_refusal()
                if not self.capabilities.cuda_graph
                else RuntimeError(f"{self._where}: a graph step before SGLang called init_cuda_graph_state")
            )
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_target_verify()):
            raise self.refusal(
                f"{mode.name} graphs (decode and target-verify graphs run through this adapter, draft-decode ones "
                "through its multi-step container)",
                "run SGLang with --disable-cuda-graph",
            )
        if not graphs.covers(forward_batch.batch_size):
            raise RuntimeError(
                f"{self._where}: a graph of batch size {forward_batch.batch_size} beyond the {graphs.max_bs} SGLang "
                f"declared in init_cuda_graph_state; {ENGINE_BUG}"
            )
        self._kv._physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))
        if mode.is_decode():
            self._kv._table = None
            self._plan(forward_batch, graphs.refresh(self._where, forward_batch, self._num_slots, ENGINE_BUG))
            return
        verify = self._verify_graphs
        if verify is None:
            if not in_capture:
                raise RuntimeError(f"{self._where}: a target-verify graph replayed before its capture; {ENGINE_BUG}")
            verify = self._verify_graphs = self._new_verify_graphs(forward_batch.spec_info, graphs.max_bs)
        self._kv._table = verify.rows.table_of(forward_batch.batch_size)  # what the batch's rows name
        batch = verify.refresh(
            self._where,
            forward_batch,
            lambda mask, committed: self._blocks(mask, committed, verify.draft_tokens),
            self._num_slots,
            ENGINE_BUG,
            in_capture,
        )
        self._plan(forward_batch, batch)

    def _new_verify_graphs(self, spec_info: Any, max_bs: int) -> VerifyGraphs:
        """The verify graphs' buffers for the verify input SGLang captures with: its draft-token count, and a tree
        mask where its steps may carry a tree (an EAGLE tree, or a verify input without ``topk`` whose mask only
        a read could tell a chain: a graph cannot read it, so it hands the backend the mask whatever it holds)."""
        draft_tokens = int(getattr(spec_info, "draft_token_num", 0) or 0)
        if draft_tokens < 1:
            raise self.refusal("a target-verify batch without draft_token_num (not an EAGLE verify input)")
        topk = getattr(spec_info, "topk", None)
        tree = getattr(spec_info, "custom_mask", None) is not None and topk != 1
        if tree and not self.capabilities.tree_mask:
            raise self.refusal(
                "speculative tree verify (this batch's custom_mask is a tree; it declares no tree_mask capability)"
                if topk is not None
                else f"target-verify graphs over {type(spec_info).__name__}'s custom masks (a graph cannot read a "
                "mask to tell a chain; it declares no tree_mask capability)",
                "run chains (--speculative-eagle-topk 1), SGLang with --disable-cuda-graph, or a backend that "
                "declares tree_mask",
            )
        req_to_token = self._kv._req_to_token_pool.req_to_token
        return VerifyGraphs(self._kv, req_to_token, max_bs, draft_tokens, tree, self.device)

    def plan_graph_step(self, forward_batch: Any, batch: ForwardBatch) -> None:
        """Draft decode step of a captured round (``multistep``): the step's graph batch over the round's table
        (which the container set as this adapter's slot table)."""
        self._kv._physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))
        self._plan(forward_batch, batch)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Nothing: every device tensor the layers read was refreshed in place out of the graph."""

    def init_forward_metadata_capture_cpu_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: Tensor,
        seq_lens: Tensor,
        out_cache_loc: Tensor,
        encoder_lens: Tensor | None,
        forward_mode: Any,
        spec_info: Any,
    ) -> None:
        """The CPU graph runner's capture of batch size ``bs``: the same host part as a CUDA capture."""
        if encoder_lens is not None:
            raise self.refusal("encoder tokens in the batch (cross-attention)")
        view = SimpleNamespace(
            batch_size=bs,
            forward_mode=forward_mode,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            spec_info=spec_info,
        )
        self.init_forward_metadata_out_graph(view, in_capture=True)

    def forward_mixed(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise self.refusal("the NPU mixed-batch path")

    def support_triton(self) -> bool:
        return False
