"""attnhost: a plugin host for LLM attention backends, with SGLang's names and semantics.

Every public name is imported lazily (PEP 562): ``import attnhost`` costs
almost nothing and pulls in neither torch nor pluggy, because every serving
worker and every CLI call imports it, and most need only a fraction.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # errors
    "AttnhostError": "attnhost.errors",
    "BackendUnavailableError": "attnhost.errors",
    "NoForwardContextError": "attnhost.errors",
    "PlatformError": "attnhost.errors",
    "PluginLoadError": "attnhost.errors",
    "RegistryFrozenError": "attnhost.errors",
    "UnknownBackendError": "attnhost.errors",
    # plugins and registry
    "BackendSpec": "attnhost.spec",
    "hookimpl": "attnhost.hooks",
    "hookspec": "attnhost.hooks",
    "ENTRY_POINT_GROUP": "attnhost.discovery",
    "PluginInfo": "attnhost.discovery",
    "PluginStatus": "attnhost.discovery",
    "Registry": "attnhost.registry",
    "get_registry": "attnhost.host",
    "get_plugin_manager": "attnhost.host",
    "register_plugin": "attnhost.host",
    "InvalidPluginError": "attnhost.host",
    "ATTENTION_BACKEND_CHOICES": "attnhost.choices",
    "DRAFT_ATTENTION_BACKEND_CHOICES": "attnhost.choices",
    "add_attention_backend_choices": "attnhost.choices",
    "add_draft_attention_backend_choices": "attnhost.choices",
    # args and resolution
    "ServerArgs": "attnhost.server_args",
    "current_platform": "attnhost.platform",
    "resolve": "attnhost.resolve",
    "resolve_attention_backends": "attnhost.resolve",
    "resolve_draft_attention_backend": "attnhost.resolve",
    "DraftResolution": "attnhost.resolve",
    "TargetResolution": "attnhost.resolve",
    # runtime
    "AttentionBackend": "attnhost.backend",
    "AttentionLayer": "attnhost.backend",
    "AttentionRunner": "attnhost.backend",
    "BackendCapabilities": "attnhost.backend",
    "KVCache": "attnhost.backend",
    "ForwardMode": "attnhost.forward_mode",
    "ForwardBatch": "attnhost.forward_batch",
    "KVPool": "attnhost.forward_batch",
    "HybridAttnBackend": "attnhost.hybrid",
    "ModelRunner": "attnhost.runner",
    "get_attn_backend": "attnhost.context",
    "dispatch_attention_backend": "attnhost.context",
}

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "DRAFT_ATTENTION_BACKEND_CHOICES",
    "ENTRY_POINT_GROUP",
    "AttentionBackend",
    "AttentionLayer",
    "AttentionRunner",
    "AttnhostError",
    "BackendCapabilities",
    "BackendSpec",
    "BackendUnavailableError",
    "DraftResolution",
    "ForwardBatch",
    "ForwardMode",
    "HybridAttnBackend",
    "InvalidPluginError",
    "KVCache",
    "KVPool",
    "ModelRunner",
    "NoForwardContextError",
    "PlatformError",
    "PluginInfo",
    "PluginLoadError",
    "PluginStatus",
    "Registry",
    "RegistryFrozenError",
    "ServerArgs",
    "TargetResolution",
    "UnknownBackendError",
    "add_attention_backend_choices",
    "add_draft_attention_backend_choices",
    "current_platform",
    "dispatch_attention_backend",
    "get_attn_backend",
    "get_plugin_manager",
    "get_registry",
    "hookimpl",
    "hookspec",
    "register_plugin",
    "resolve",
    "resolve_attention_backends",
    "resolve_draft_attention_backend",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnhost' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend, AttentionLayer, AttentionRunner, BackendCapabilities, KVCache
    from attnhost.choices import (
        ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_draft_attention_backend_choices,
    )
    from attnhost.context import dispatch_attention_backend, get_attn_backend
    from attnhost.discovery import ENTRY_POINT_GROUP, PluginInfo, PluginStatus
    from attnhost.errors import (
        AttnhostError,
        BackendUnavailableError,
        NoForwardContextError,
        PlatformError,
        PluginLoadError,
        RegistryFrozenError,
        UnknownBackendError,
    )
    from attnhost.forward_batch import ForwardBatch, KVPool
    from attnhost.forward_mode import ForwardMode
    from attnhost.hooks import hookimpl, hookspec
    from attnhost.host import InvalidPluginError, get_plugin_manager, get_registry, register_plugin
    from attnhost.hybrid import HybridAttnBackend
    from attnhost.platform import current_platform
    from attnhost.registry import Registry
    from attnhost.resolve import (
        DraftResolution,
        TargetResolution,
        resolve,
        resolve_attention_backends,
        resolve_draft_attention_backend,
    )
    from attnhost.runner import ModelRunner
    from attnhost.server_args import ServerArgs
    from attnhost.spec import BackendSpec
