"""What an SGLang model runner brings an adapter, checked when the adapter is built: its model kind and its pools.

SGLang builds the attention backends after it has built the runner's pools, so every pool fact that decides
whether an attnhost backend can serve the runner is known then: the refusals come at start-up, where the engine
hands the error to the caller, never on a batch. The model's own layers are walked beside this
(``model_checks``); an MLA runner gets its own checks (``mla``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from attnhost.backend import dtype_name
from attnhost.dtypes import FP8_DTYPES
from attnhost.engines.sglang.model_checks import model_name, variant_way_out

if TYPE_CHECKING:
    from attnhost.engines.identity import BackendIdentity
    from attnhost.engines.sglang.model_checks import Peers

__all__ = ["check_cache", "check_runner", "slots_per_layer"]


def check_runner(identity: BackendIdentity, runner: Any, peers: Peers) -> None:
    """Refuse a runner the dense adapter cannot serve: an MLA or encoder-decoder model, a pool it cannot read, a
    window model for a backend without windows."""
    refuse = identity.refuse
    if getattr(runner, "use_mla_backend", False):
        raise refuse("MLA models (multi-head latent attention)")
    model_config = getattr(runner, "model_config", None)
    if getattr(model_config, "is_encoder_decoder", False):
        raise refuse("encoder-decoder models (cross-attention)")
    pool = runner.token_to_kv_pool
    pools = [pool]
    if isinstance(pool, SWAKVPool):  # SGLang's hybrid pool: the window layers' keys in a pool of their own
        if getattr(getattr(runner, "kv_index_translator", None), "is_translating", False):
            raise refuse(
                "SGLang's unified memory pool (its req_to_token holds virtual KV ids)",
                "run SGLang without --enable-unified-memory",
            )
        if not pool.full_layer_nums:
            raise refuse("a hybrid KV pool without full-attention layers", "use --disable-hybrid-swa-memory")
        pools = [pool.full_kv_pool, pool.swa_kv_pool]
    if getattr(runner, "is_hybrid_swa", False) and not identity.capabilities.sliding_window:
        # SGLang's own start-up word that the model has window layers: refused before any layer is walked
        raise refuse(
            f"sliding-window attention, which {model_name(runner)} needs (SGLang's is_hybrid_swa; it does not "
            "declare sliding_window)",
            variant_way_out(identity, ("sliding_window",), peers),
        )
    for part in pools:
        _check_pool(identity, runner, part)


def _check_pool(identity: BackendIdentity, runner: Any, pool: Any) -> None:
    refuse = identity.refuse
    if not isinstance(pool, MHATokenToKVPool):
        raise refuse(f"SGLang's {type(pool).__name__} (it reads MHATokenToKVPool)")
    if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", None) not in (None, "NHD", "nhd"):
        raise refuse("a head-major (HND) KV-cache layout", "unset SGLANG_USE_HND_KVCACHE")
    if getattr(pool, "is_quantized_kv_cache", False):
        raise refuse(
            f"SGLang's block-quantized KV cache ({type(getattr(pool, 'quant_method', None)).__name__})",
            "use --kv-cache-dtype auto, fp8_e4m3 or fp8_e5m2",
        )
    if pool.v_head_dim != pool.head_dim:
        raise refuse(f"a V head dim ({pool.v_head_dim}) unlike the QK head dim ({pool.head_dim})")
    model_dtype = dtype_name(getattr(runner, "dtype", pool.dtype))
    reason = identity.capabilities.refusal(dtype=model_dtype, head_dim=pool.head_dim)
    if reason is not None:
        raise refuse(reason, f"choose another --dtype or {identity.flag}")
    check_cache(identity, pool)


def check_cache(identity: BackendIdentity, pool: Any) -> None:
    """Refuse a cache format the backend does not declare (``BackendCapabilities.cache_refusal``): an FP8 one
    (SGLang's ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``, stored through a ``uint8`` view) or a page size
    (``--page-size``); any other stored form is no format of the contract."""
    dtype, store = pool.dtype, getattr(pool, "store_dtype", pool.dtype)
    if store != dtype and not (dtype in FP8_DTYPES and store == torch.uint8):
        raise identity.refuse(
            f"a KV cache of dtype {dtype_name(dtype)} stored as {dtype_name(store)}", "use --kv-cache-dtype auto"
        )
    page_size = int(getattr(pool, "page_size", 1) or 1)
    reason = identity.capabilities.cache_refusal(kv_dtype=dtype_name(dtype), page_size=page_size)
    if reason is not None:
        raise identity.refuse(
            reason,
            f"run SGLang with a --kv-cache-dtype and --page-size it declares (this cache: {dtype_name(dtype)} in "
            f"pages of {page_size}), or choose with {identity.flag} a backend that declares them (e.g. "
            "attnhost_torch_native)",
        )


def slots_per_layer(pool: Any) -> int:
    """How many slots ``out_cache_loc`` may name: a layer's buffer rows, the full pool's in a hybrid pool."""
    if isinstance(pool, SWAKVPool):
        return int(pool.full_kv_pool.k_buffer[0].shape[0])
    first_layer = getattr(pool, "start_layer", 0) or 0  # pipeline stages start further on
    return int(pool.get_key_buffer(first_layer).shape[0])  # as many in every layer
