"""The environment variables that steer plugin loading, read once per load.

Operators set these in service units and container specs, so every value is
parsed forgivingly (``1``/``true``/``yes``) and every name is documented in
one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "DISABLE_AUTOLOAD_ENV",
    "NO_CACHE_ENV",
    "PLUGINS_ENV",
    "STRICT_ENV",
    "LoadSettings",
    "env_flag",
]

PLUGINS_ENV = "ATTNHOST_PLUGINS"
DISABLE_AUTOLOAD_ENV = "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"
STRICT_ENV = "ATTNHOST_STRICT"
NO_CACHE_ENV = "ATTNHOST_NO_CACHE"

_TRUE = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true-ish value."""
    return os.environ.get(name, "").strip().lower() in _TRUE


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Which third-party plugins may load, and whether a failure is fatal."""

    allow: frozenset[str] | None
    """``None``: every plugin; otherwise only these (the built-ins always load)."""
    autoload: bool
    strict: bool

    @classmethod
    def from_env(cls) -> LoadSettings:
        raw = os.environ.get(PLUGINS_ENV)
        allow = None
        if raw is not None and raw.strip():
            allow = frozenset(part.strip() for part in raw.split(",") if part.strip())
        return cls(allow=allow, autoload=not env_flag(DISABLE_AUTOLOAD_ENV), strict=env_flag(STRICT_ENV))
