"""Every environment variable attnhost reads, and the one rule for reading them.

Operators set these in service units and container specs, so they are named
in one place and every boolean is read by the same forgiving rule
(:func:`env_flag`: ``1``/``true``/``yes``/``on``, any case, mean yes).
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = [
    "DEBUG_ENV",
    "DISABLE_AUTOLOAD_ENV",
    "NO_CACHE_ENV",
    "PLATFORM_ENV",
    "PLUGINS_ENV",
    "STRICT_ENV",
    "LoadSettings",
    "env_flag",
    "env_text",
]

PLUGINS_ENV = "ATTNHOST_PLUGINS"
"""Comma-separated allow-list of third-party plugin names (the built-ins always load)."""
DISABLE_AUTOLOAD_ENV = "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"
"""Boolean: load only the built-in plugin."""
STRICT_ENV = "ATTNHOST_STRICT"
"""Boolean: a plugin that fails to load is an error, not a warning."""
PLATFORM_ENV = "ATTNHOST_PLATFORM"
"""Overrides platform detection (``cuda``, ``rocm``, ``xpu``, ``npu``, ``mps``, ``cpu``)."""
DEBUG_ENV = "ATTNHOST_DEBUG"
"""Boolean: the CLI re-raises unexpected errors with their traceback."""
NO_CACHE_ENV = "ATTNHOST_NO_CACHE"
"""Boolean: entry-point discovery neither reads nor writes its on-disk cache."""

_TRUE = frozenset({"1", "true", "yes", "on"})


def env_text(name: str) -> str:
    """The variable's value with surrounding white space removed; empty when unset."""
    return os.environ.get(name, "").strip()


def env_flag(name: str) -> bool:
    """Whether the boolean variable ``name`` is set to a true value."""
    return env_text(name).lower() in _TRUE


class LoadSettings(NamedTuple):
    """Which third-party plugins may load, and whether a failure is fatal (immutable, compared by value)."""

    allow: frozenset[str] | None
    """``None``: every plugin; otherwise only these (the built-ins always load)."""
    autoload: bool
    strict: bool

    @classmethod
    def from_env(cls) -> LoadSettings:
        raw = env_text(PLUGINS_ENV)
        allow = frozenset(part.strip() for part in raw.split(",") if part.strip()) if raw else None
        return cls(allow=allow, autoload=not env_flag(DISABLE_AUTOLOAD_ENV), strict=env_flag(STRICT_ENV))
