"""Every environment variable attnhost reads, the one rule for reading them, and the one time they are read.

Operators set these in service units and container specs, so they are named
in one place, every boolean is read by the same rule (:func:`parse_flag`),
and the whole set is read once per process, into :func:`current`, the first
time anything asks: plugin loading asks before it imports the first plugin,
so no plugin's import-time code can switch strict mode off or move the
platform under a command that has started.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = [
    "BOOLEAN_ENV",
    "DEBUG_ENV",
    "DISABLE_AUTOLOAD_ENV",
    "NAME_LIST_ENV",
    "NO_CACHE_ENV",
    "PLATFORM_ENV",
    "PLUGINS_ENV",
    "SGLANG_OVERRIDE_ENV",
    "STRICT_ENV",
    "VLLM_OVERRIDE_ENV",
    "LoadSettings",
    "Settings",
    "current",
    "env_flag",
    "env_text",
    "parse_flag",
]

logger = logging.getLogger(__name__)

PLUGINS_ENV = "ATTNHOST_PLUGINS"
"""Comma-separated allow-list of third-party plugin names (the built-ins always load).

Unset: every installed plugin loads. Set, it is an allow-list even when it
names nothing: ``ATTNHOST_PLUGINS=`` and ``ATTNHOST_PLUGINS=,`` both load
only the built-ins, as vLLM's ``VLLM_PLUGINS=`` loads no plugin.
"""
DISABLE_AUTOLOAD_ENV = "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"
"""Boolean: load only the built-in plugin."""
STRICT_ENV = "ATTNHOST_STRICT"
"""Boolean: a plugin that fails to load is an error, not a warning."""
PLATFORM_ENV = "ATTNHOST_PLATFORM"
"""Overrides platform detection (``cuda``, ``rocm``, ``xpu``, ``npu``, ``mps``, ``cpu``)."""
DEBUG_ENV = "ATTNHOST_DEBUG"
"""Boolean: the CLI re-raises unexpected errors with their traceback."""
SGLANG_OVERRIDE_ENV = "ATTNHOST_SGLANG_OVERRIDE"
"""Comma-separated attnhost backend names allowed to replace SGLang's own implementation of that name."""
VLLM_OVERRIDE_ENV = "ATTNHOST_VLLM_OVERRIDE"
"""Comma-separated attnhost backend names allowed to replace vLLM's own backend of that (upper-cased) name."""
NO_CACHE_ENV = "ATTNHOST_NO_CACHE"
"""Boolean: entry-point discovery neither reads nor writes its on-disk cache."""

BOOLEAN_ENV: tuple[str, ...] = (DISABLE_AUTOLOAD_ENV, STRICT_ENV, DEBUG_ENV, NO_CACHE_ENV)
"""The boolean variables: each is read by :func:`parse_flag`."""
NAME_LIST_ENV: tuple[str, ...] = (SGLANG_OVERRIDE_ENV, VLLM_OVERRIDE_ENV)
"""The engine bridges' comma-separated name lists."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def env_text(name: str) -> str:
    """The variable's value now, with surrounding white space removed; empty when unset."""
    return os.environ.get(name, "").strip()


def parse_flag(name: str, raw: str | None) -> tuple[bool, str | None]:
    """The one rule for booleans: ``(value, warning)``.

    ``1``/``true``/``yes``/``on`` mean yes and unset, empty, ``0``/``false``/
    ``no``/``off`` mean no, in any case and with white space ignored. Any
    other value means no (the setting stays off rather than switching on by
    accident) and comes back with a warning naming the variable.
    """
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True, None
    if value in _FALSE:
        return False, None
    return False, (
        f"{name}={raw!r} is not a boolean, so it is off; set it to 1, true, yes or on (or 0, false, no, off or nothing)"
    )


class LoadSettings(NamedTuple):
    """Which third-party plugins may load, and whether a failure is fatal (immutable, compared by value)."""

    allow: frozenset[str] | None
    """``None``: every plugin; otherwise only these (the built-ins always load)."""
    autoload: bool
    strict: bool

    @classmethod
    def from_env(cls) -> LoadSettings:
        """The load settings as the process read them (:func:`current`), not as the environment is now."""
        return current().load


class Settings(NamedTuple):
    """Every setting, as read from the environment once per process."""

    load: LoadSettings
    platform: str
    """``ATTNHOST_PLATFORM``'s text, empty when unset (validated where it is used)."""
    flags: Mapping[str, bool]
    """Each boolean variable of :data:`BOOLEAN_ENV` → its value."""
    warnings: tuple[str, ...]
    """One line per variable whose value the rule does not recognise (logged once, when read)."""
    name_lists: Mapping[str, frozenset[str]]
    """Each variable of :data:`NAME_LIST_ENV` → the names it lists (empty when unset)."""

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Settings:
        flags: dict[str, bool] = {}
        warnings: list[str] = []
        for name in BOOLEAN_ENV:
            flags[name], warning = parse_flag(name, environ.get(name))
            if warning:
                warnings.append(warning)
        raw = environ.get(PLUGINS_ENV)
        allow = None if raw is None else frozenset(part.strip() for part in raw.split(",") if part.strip())
        load = LoadSettings(allow=allow, autoload=not flags[DISABLE_AUTOLOAD_ENV], strict=flags[STRICT_ENV])
        platform = environ.get(PLATFORM_ENV, "").strip()
        name_lists = {
            name: frozenset(part.strip() for part in environ.get(name, "").split(",") if part.strip())
            for name in NAME_LIST_ENV
        }
        return cls(load, platform, MappingProxyType(flags), tuple(warnings), MappingProxyType(name_lists))


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The settings of this process, read from the environment the first time anything asks.

    Reading them once is what makes them trustworthy: the plugin host asks
    before it imports any plugin, so a plugin's import-time code that
    changes ``os.environ`` changes nothing that attnhost decides.
    """
    settings = _current
    if settings is None:
        with _lock:
            settings = _current
            if settings is None:
                settings = _take_snapshot()
    return settings


def _take_snapshot() -> Settings:
    global _current
    settings = _current = Settings.read(os.environ)
    for warning in settings.warnings:
        logger.warning("%s", warning)
    return settings


def env_flag(name: str) -> bool:
    """Whether the boolean variable ``name`` (one of :data:`BOOLEAN_ENV`) was set to a true value."""
    flags = current().flags
    if name not in flags:
        raise KeyError(f"{name} is not one of attnhost's boolean variables ({', '.join(BOOLEAN_ENV)})")
    return flags[name]


def _reset_for_tests() -> None:
    """Forget the settings read, so the next :func:`current` reads the environment again (tests only)."""
    global _current
    with _lock:
        _current = None
