"""``ModelRunner``: one model (target or draft) with its own KV cache and its own backend.

A runner builds its own backend, stamps its names on it and enters its own forward context; it never writes to
the args, a module global or another runner, so the per-runner isolation (docs/architecture.md) holds by construction.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from attnhost import resolution
from attnhost.availability import check_availability
from attnhost.backend import (
    AttentionBackend,
    AttentionLayer,
    BackendCapabilities,
    capabilities_of,
    dtype_name,
)
from attnhost.building import build_backend
from attnhost.context import ForwardContext
from attnhost.dtypes import FP8_DTYPES, check_size, float_dtype, resolve_kv_cache_dtype
from attnhost.errors import BackendUnavailableError, UnsupportedFeatureError, describe_exception, printable_record
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode, per_mode
from attnhost.hooks import plugin_output
from attnhost.host import get_registry
from attnhost.hybrid import HybridAttnBackend
from attnhost.kv_pool import KVPool
from attnhost.mla import MLAConfig, MLAForm
from attnhost.mla_pool import MLAKVPool
from attnhost.platform import current_platform
from attnhost.server_args import KV_CACHE_DTYPES, ServerArgs

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

__all__ = ["ModelRunner"]

logger = logging.getLogger(__name__)
logger.addFilter(printable_record)  # plugin text in a log line is escaped

_SIZES = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "max_requests", "max_context_len")
# per_mode for backend names, remembered: every forward enters a context, and per_mode takes microseconds.
_dispatch_names: Callable[[str, str, str], tuple[str, ...]] = functools.lru_cache(maxsize=256)(per_mode)


class ModelRunner:
    """A target or draft model runner: shape, KV cache, and an isolated attention backend."""

    def __init__(
        self,
        args: ServerArgs,
        *,
        is_draft: bool = False,
        num_layers: int = 2,
        num_heads: int = 8,
        num_kv_heads: int = 2,
        head_dim: int = 64,
        max_requests: int = 16,
        max_context_len: int = 2048,
        num_slots: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        platform: str | None = None,  # overrides detection, as --platform does
        mla: MLAConfig | None = None,
        kv_cache_dtype: torch.dtype | str | None = None,
        page_size: int | None = None,
        table_dtype: torch.dtype = torch.int64,
        fused_kv: bool = False,
    ) -> None:
        """``mla``: the model uses multi-head latent attention (``num_kv_heads`` and ``head_dim`` are then
        ignored): its cache is an :class:`~attnhost.mla_pool.MLAKVPool`, ``layers`` are the absorbed form and
        ``mha_layers`` the MHA form of the same layers, and a backend that does not declare ``mla`` is refused
        here.

        ``table_dtype`` (``req_to_token``'s, int32 as SGLang keeps it) and ``fused_kv`` (a layer's K and V in one
        buffer, so strided views) lay the cache out as engines do (:class:`~attnhost.forward_batch.KVPool`); an MLA
        cache has no separate V to fuse.

        ``kv_cache_dtype`` (a torch dtype, its name or an ``--kv-cache-dtype`` value; default:
        ``args.kv_cache_dtype``; ``auto``: ``dtype``) and ``page_size`` (default: ``args.page_size``) shape the
        cache (docs/kv-cache.md); a backend that does not declare them is refused here, by name, before any
        batch."""
        if not isinstance(args, ServerArgs):
            raise TypeError(f"ModelRunner needs an attnhost.ServerArgs, not {type(args).__name__}")
        sizes = (num_layers, num_heads, num_kv_heads, head_dim, max_requests, max_context_len)
        for name, value in zip(_SIZES, sizes, strict=True):
            check_size("ModelRunner", name, value)
        if num_slots is None:
            num_slots = max_requests * max_context_len // 4
            if num_slots == 0:
                raise ValueError(
                    f"ModelRunner: max_requests={max_requests} and max_context_len={max_context_len} leave no "
                    "KV slots (the default num_slots is max_requests * max_context_len // 4); pass num_slots"
                )
        check_size("ModelRunner", "num_slots", num_slots)
        self.args = args
        self.is_draft = is_draft
        self.role = "draft" if is_draft else "target"
        self.platform = current_platform(platform)
        self.dtype = float_dtype("ModelRunner", dtype)
        self.device = torch.device(device)
        self.mla = mla
        cache_dtype: torch.dtype | str | None = args.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
        if isinstance(cache_dtype, str) and cache_dtype in KV_CACHE_DTYPES:  # SGLang's flag values
            cache_dtype = KV_CACHE_DTYPES[cache_dtype]
        self.kv_cache_dtype = resolve_kv_cache_dtype("ModelRunner", cache_dtype or self.dtype)
        self.page_size = args.page_size if page_size is None else page_size
        check_size("ModelRunner", "page_size", self.page_size)
        if mla is not None and self.kv_cache_dtype in FP8_DTYPES:
            raise UnsupportedFeatureError(
                f"{self.role} runner: an MLA model with an FP8 KV cache ({dtype_name(self.kv_cache_dtype)}): the "
                "contract's FP8 cache (docs/kv-cache.md) is per-head K/V; use --kv-cache-dtype auto"
            )
        if mla is not None and fused_kv:
            raise ValueError(
                "ModelRunner: fused_kv lays out separate K and V buffers; an MLA cache has one latent buffer"
            )
        self.kv_pool: KVPool
        if mla is None:
            self.layers = tuple(AttentionLayer(i, num_heads, num_kv_heads, head_dim) for i in range(num_layers))
            self.mha_layers: tuple[AttentionLayer, ...] = ()
            self.kv_pool = KVPool(
                num_layers,
                num_slots,
                num_kv_heads,
                head_dim,
                max_requests=max_requests,
                max_context_len=max_context_len,
                dtype=self.kv_cache_dtype,
                device=self.device,
                page_size=self.page_size,
                table_dtype=table_dtype,
                fused_kv=fused_kv,
            )
        else:
            self.layers = tuple(AttentionLayer.for_mla(mla, MLAForm.ABSORBED, i, num_heads) for i in range(num_layers))
            self.mha_layers = tuple(AttentionLayer.for_mla(mla, MLAForm.MHA, i, num_heads) for i in range(num_layers))
            self.kv_pool = MLAKVPool(
                num_layers,
                num_slots,
                mla,
                max_requests=max_requests,
                max_context_len=max_context_len,
                dtype=self.kv_cache_dtype,
                device=self.device,
                page_size=self.page_size,
                table_dtype=table_dtype,
            )
        self.resolution: resolution.TargetResolution | resolution.DraftResolution
        if is_draft:
            self.resolution = resolution.resolve_draft_attention_backend(args, self.platform)
            if self.resolution.problem is not None:
                # Said before the generic "unavailable": the user may never have named this backend (a fallback).
                raise BackendUnavailableError(f"draft runner: {self.resolution.problem}")
            prefill = decode = self.resolution.name
        else:
            self.resolution = resolution.resolve_attention_backends(args, self.platform)
            prefill, decode = self.resolution.prefill, self.resolution.decode
        label = get_registry().entry
        self._capabilities: dict[str, BackendCapabilities] = {}
        backend = self._build_one(prefill)
        built = f"{prefill!r} from {label(prefill).label}"
        if prefill != decode:
            backend = HybridAttnBackend(backend, self._build_one(decode), args.speculative_attention_mode)
            built = f"prefill {built}, decode {decode!r} from {label(decode).label}"
        self.attn_backend = backend
        self.prefill_attention_backend_str = backend.prefill_attention_backend_str = prefill
        self.decode_attention_backend_str = backend.decode_attention_backend_str = decode
        # The backend name that serves each forward mode, as HybridAttnBackend routes it: what a tree must ask.
        self._name_by_mode = per_mode(prefill, decode, args.speculative_attention_mode)
        logger.info(
            "%s runner: built attention backend %s; why: %s", self.role, built, "; ".join(self.resolution.trace)
        )

    def __repr__(self) -> str:
        return (
            f"<ModelRunner {self.role} prefill={self.prefill_attention_backend_str!r} "
            f"decode={self.decode_attention_backend_str!r} on {self.platform}>"
        )

    def _build_one(self, name: str) -> AttentionBackend:
        """Build and stamp backend ``name``; every refusal names the runner, the backend and its plugin."""
        entry = get_registry().entry(name)
        where = f"{self.role} runner: attention backend {name!r} from {entry.label}"
        availability = check_availability(entry, self.platform)
        if not availability.available:
            raise BackendUnavailableError(
                f"{where} is unavailable: {availability.reason}; choose another backend (see `attnhost list`)"
            )
        fix = f"fix or reinstall {entry.distribution}" if entry.distribution else "fix the plugin"
        way_out = f"{fix}, or choose another backend"
        try:
            with plugin_output():  # importing plugin code: stdout is not its to write
                factory = entry.spec.load()
        except (Exception, SystemExit) as exc:
            raise BackendUnavailableError(f"{where} could not be loaded: {describe_exception(exc)}; {way_out}") from exc
        owner = entry.distribution or f"plugin {entry.plugin!r}"
        try:
            self._capabilities[name] = capabilities_of(factory)
        except TypeError as exc:
            raise BackendUnavailableError(f"{where} declares no usable capabilities: {exc}; {way_out}") from exc
        if self.mla is not None and not self._capabilities[name].mla:
            m = self.mla
            raise UnsupportedFeatureError(
                f"{where} cannot serve this MLA model (multi-head latent attention, kv_lora_rank {m.kv_lora_rank}, "
                f"qk_rope_head_dim {m.qk_rope_head_dim}): it does not declare BackendCapabilities.mla; choose a "
                "backend that declares it (e.g. torch_native)"
            )
        cache = self._capabilities[name].cache_refusal(
            kv_dtype=dtype_name(self.kv_cache_dtype), page_size=self.page_size
        )
        if cache is not None:
            raise UnsupportedFeatureError(
                f"{where} cannot read {cache}; choose another --kv-cache-dtype or --page-size, or a backend that "
                "declares them (e.g. torch_native)"
            )
        backend = build_backend(factory, self, where=where, way_out=way_out, owner=owner)
        backend.prefill_attention_backend_str = backend.decode_attention_backend_str = name
        return backend

    def forward_context(self) -> AbstractContextManager[AttentionBackend]:
        """Make this runner's backend current in the ``with``; dispatch reads its stamps (else the args'), as SGLang."""
        backend = self.attn_backend
        default_prefill, default_decode = self.args.get_attention_backends()
        prefill = backend.prefill_attention_backend_str or default_prefill
        decode = backend.decode_attention_backend_str or default_decode
        if prefill is None or decode is None:
            raise BackendUnavailableError(
                f"{self.role} runner: its backend carries no backend names and the args name none"
            )
        names = _dispatch_names(prefill, decode, self.args.speculative_attention_mode)
        return ForwardContext(backend, names).activate()

    def new_request(self) -> int:
        """Allocate a request slot in this runner's KV cache."""
        return self.kv_pool.alloc_request()

    def prepare_batch(
        self, mode: ForwardMode, requests: Iterable[tuple[int, int, int]], tree_mask: torch.Tensor | None = None
    ) -> ForwardBatch:
        """Allocate KV slots for ``(request, prefix_len, extend_len)`` triples and build the batch; a tree mask for
        a backend that does not declare ``tree_mask`` (it would attend causally) is refused before any slot is taken."""
        if tree_mask is not None and not mode.is_decode_or_idle():  # ForwardBatch refuses a tree there anyway
            name = self._name_by_mode[mode]
            if not self._capabilities[name].tree_mask:
                raise UnsupportedFeatureError(
                    f"{self.role} runner: attention backend {name!r} does not declare tree_mask "
                    f"(BackendCapabilities), so it cannot attend a speculative tree in a {mode.name} batch; "
                    "use chains (speculative topk 1) or a backend that declares tree_mask"
                )
        batch = ForwardBatch.prepare(self.kv_pool, mode, requests, tree_mask)
        self.attn_backend.init_forward_metadata(batch)
        return batch
