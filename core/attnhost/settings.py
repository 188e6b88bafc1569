"""The environment variables that steer plugin loading, read once per load.

Operators set these in service units and container specs, so every value is
parsed forgivingly (``1``/``true``/``yes``) and every name is documented in
one place.
"""

from __future__ import annotations

import os

from attnhost.entry_points import NO_CACHE_ENV  # owned by the scanner; listed here with the others

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

_TRUE = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true-ish value."""
    return os.environ.get(name, "").strip().lower() in _TRUE


class LoadSettings:
    """Which third-party plugins may load, and whether a failure is fatal.

    Immutable, compared by value. Hand-written rather than a frozen dataclass:
    every CLI call builds this class, and generating a dataclass costs ~0.3 ms
    of a start-up budget measured in single milliseconds (BENCHMARKS.md).
    """

    __slots__ = ("allow", "autoload", "strict")

    allow: frozenset[str] | None
    """``None``: every plugin; otherwise only these (the built-ins always load)."""
    autoload: bool
    strict: bool

    def __init__(self, allow: frozenset[str] | None, autoload: bool, strict: bool) -> None:
        set_ = object.__setattr__
        set_(self, "allow", allow)
        set_(self, "autoload", autoload)
        set_(self, "strict", strict)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"LoadSettings is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"LoadSettings is immutable; cannot delete {name!r}")

    def _key(self) -> tuple[frozenset[str] | None, bool, bool]:
        return (self.allow, self.autoload, self.strict)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, LoadSettings)
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"LoadSettings(allow={self.allow!r}, autoload={self.autoload!r}, strict={self.strict!r})"

    @classmethod
    def from_env(cls) -> LoadSettings:
        raw = os.environ.get(PLUGINS_ENV)
        allow = None
        if raw is not None and raw.strip():
            allow = frozenset(part.strip() for part in raw.split(",") if part.strip())
        return cls(allow=allow, autoload=not env_flag(DISABLE_AUTOLOAD_ENV), strict=env_flag(STRICT_ENV))
