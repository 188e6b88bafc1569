"""attnhost: a plugin host for LLM attention backends, with SGLang's names and semantics. Every public name is imported
lazily (PEP 562) from the one table below: ``import attnhost`` pulls in neither torch nor pluggy."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC: dict[str, str] = {
    "errors": "AttnhostError BackendFailedError BackendUnavailableError InvalidBatchError InvalidPluginError "
    "KVPoolFullError NoForwardContextError PlatformError PluginLoadError RankCheckError RankMismatchError "
    "RegistryFrozenError UnknownBackendError UnsupportedFeatureError",
    "spec": "BackendFactory BackendSpec",
    "hooks": "hookimpl",
    "discovery": "ENTRY_POINT_GROUP PluginInfo PluginStatus",
    "registry": "BackendEntry Registry",
    "availability": "Availability check_availability",
    "host": "get_plugin_manager get_registry register_plugin",
    "choices": "ATTENTION_BACKEND_CHOICES DRAFT_ATTENTION_BACKEND_CHOICES add_attention_backend_choices "
    "add_draft_attention_backend_choices",
    "server_args": "ServerArgs",
    "platform": "current_platform",
    "resolution": "DraftResolution Resolution TargetResolution resolve resolve_attention_backends "
    "resolve_draft_attention_backend",
    "backend": "AttentionBackend AttentionLayer AttentionRunner BackendCapabilities KVCache FLOAT_DTYPES "
    "FP8_KV_DTYPES VARIANT_FEATURES",
    "mla": "MLAConfig MLAForm",
    "forward_mode": "ForwardMode",
    "forward_batch": "ForwardBatch",
    "kv_pool": "KVPool",
    "dtypes": "FP8_DTYPES quantize_fp8",
    "hybrid": "HybridAttnBackend",
    "runner": "ModelRunner",
    "context": "dispatch_attention_backend get_attn_backend",
}

_MODULE_OF = {name: f"attnhost.{module}" for module, names in _PUBLIC.items() for name in names.split()}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'attnhost' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        from attnhost.platform import TORCH_HINT

        raise ModuleNotFoundError(
            f"attnhost.{name} needs torch, which is not installed: {TORCH_HINT}",
            name="torch",
        ) from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]


if TYPE_CHECKING:  # what type checkers see (re-exported: pyproject.toml); tests/test_public_api.py checks it
    from attnhost.availability import Availability, check_availability
    from attnhost.backend import (
        FLOAT_DTYPES,
        FP8_KV_DTYPES,
        VARIANT_FEATURES,
        AttentionBackend,
        AttentionLayer,
        AttentionRunner,
        BackendCapabilities,
        KVCache,
    )
    from attnhost.choices import (
        ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_draft_attention_backend_choices,
    )
    from attnhost.context import dispatch_attention_backend, get_attn_backend
    from attnhost.discovery import ENTRY_POINT_GROUP, PluginInfo, PluginStatus
    from attnhost.dtypes import FP8_DTYPES, quantize_fp8
    from attnhost.errors import (
        AttnhostError,
        BackendFailedError,
        BackendUnavailableError,
        InvalidBatchError,
        InvalidPluginError,
        KVPoolFullError,
        NoForwardContextError,
        PlatformError,
        PluginLoadError,
        RankCheckError,
        RankMismatchError,
        RegistryFrozenError,
        UnknownBackendError,
        UnsupportedFeatureError,
    )
    from attnhost.forward_batch import ForwardBatch
    from attnhost.forward_mode import ForwardMode
    from attnhost.hooks import hookimpl
    from attnhost.host import get_plugin_manager, get_registry, register_plugin
    from attnhost.hybrid import HybridAttnBackend
    from attnhost.kv_pool import KVPool
    from attnhost.mla import MLAConfig, MLAForm
    from attnhost.platform import current_platform
    from attnhost.registry import BackendEntry, Registry
    from attnhost.resolution import (
        DraftResolution,
        Resolution,
        TargetResolution,
        resolve,
        resolve_attention_backends,
        resolve_draft_attention_backend,
    )
    from attnhost.runner import ModelRunner
    from attnhost.server_args import ServerArgs
    from attnhost.spec import BackendFactory, BackendSpec
