"""Every environment variable attnhost reads, the one rule for reading them, and the one time they are read.

Read once per process (:func:`current`), the first time anything asks: plugin loading asks before it imports the
first plugin, so no plugin's import-time code can switch strict mode off or move the platform.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["BOOLEAN_ENV", "DEBUG_ENV", "DISABLE_AUTOLOAD_ENV", "NAME_LIST_ENV", "NO_CACHE_ENV", "PLATFORM_ENV"]
__all__ += ["PLUGINS_ENV", "SGLANG_OVERRIDE_ENV", "STRICT_ENV", "VLLM_OVERRIDE_ENV", "LoadSettings", "Settings"]
__all__ += ["current", "env_flag", "parse_flag"]

logger = logging.getLogger(__name__)

PLUGINS_ENV = "ATTNHOST_PLUGINS"
"""Comma-separated allow-list of third-party plugin names (the built-ins always load). Unset: every installed
plugin loads. Set, it is an allow-list even when it names nothing: ``ATTNHOST_PLUGINS=`` and ``ATTNHOST_PLUGINS=,``
both load only the built-ins, as vLLM's ``VLLM_PLUGINS=`` loads no plugin. Its order is a preference: of two plugins
implementing one backend name, the one listed first keeps it."""
DISABLE_AUTOLOAD_ENV = "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"  # boolean: load only the built-in plugin
STRICT_ENV = "ATTNHOST_STRICT"  # boolean: a plugin that fails to load is an error, not a warning
PLATFORM_ENV = "ATTNHOST_PLATFORM"  # overrides platform detection (cuda, rocm, xpu, npu, mps, cpu)
DEBUG_ENV = "ATTNHOST_DEBUG"  # boolean: the CLI re-raises unexpected errors with their traceback
NO_CACHE_ENV = "ATTNHOST_NO_CACHE"  # boolean: entry-point discovery neither reads nor writes its on-disk cache
SGLANG_OVERRIDE_ENV = "ATTNHOST_SGLANG_OVERRIDE"  # names allowed to replace SGLang's own implementation of the name
VLLM_OVERRIDE_ENV = "ATTNHOST_VLLM_OVERRIDE"  # names allowed to replace vLLM's own backend of the (upper-cased) name

BOOLEAN_ENV: tuple[str, ...] = (DISABLE_AUTOLOAD_ENV, STRICT_ENV, DEBUG_ENV, NO_CACHE_ENV)
NAME_LIST_ENV: tuple[str, ...] = (SGLANG_OVERRIDE_ENV, VLLM_OVERRIDE_ENV)  # the engine bridges' comma-separated lists

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_flag(name: str, raw: str | None) -> tuple[bool, str | None]:
    """The one rule for booleans, ``(value, warning)``: ``1``/``true``/``yes``/``on`` mean yes and unset, empty,
    ``0``/``false``/``no``/``off`` no, in any case and white space ignored; any other value means no (the setting
    stays off rather than switching on by accident) and comes back with a warning naming the variable."""
    value = (raw or "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE, None
    return False, (
        f"{name}={raw!r} is not a boolean, so it is off; set it to 1, true, yes or on (or 0, false, no, off or nothing)"
    )


class LoadSettings(NamedTuple):
    """Which third-party plugins may load, and whether a failure is fatal (immutable, compared by value)."""

    allow: frozenset[str] | None  # None: every plugin; otherwise only these (the built-ins always load)
    autoload: bool
    strict: bool
    preference: tuple[str, ...] = ()
    """``ATTNHOST_PLUGINS``'s names in the order given: the plugins listed load (and register) first, in that
    order, so of two plugins implementing one backend name the one listed first keeps it."""

    @classmethod
    def from_env(cls) -> LoadSettings:
        """The load settings as the process read them (:func:`current`), not as the environment is now."""
        return current().load


class Settings(NamedTuple):
    """Every setting, as read from the environment once per process."""

    load: LoadSettings
    platform: str  # ATTNHOST_PLATFORM's text, empty when unset (validated where it is used)
    flags: Mapping[str, bool]  # each variable of BOOLEAN_ENV → its value
    name_lists: Mapping[str, frozenset[str]]  # each variable of NAME_LIST_ENV → the names it lists


_lock = threading.Lock()
_current: Settings | None = None


def _names(raw: str) -> frozenset[str]:
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def current() -> Settings:
    """The settings of this process, read from the environment (any warning logged) the first time anything asks:
    the plugin host asks before it imports any plugin, so a plugin's import-time code changes nothing."""
    global _current
    with _lock:
        if _current is None:
            flags: dict[str, bool] = {}
            for name in BOOLEAN_ENV:
                flags[name], warning = parse_flag(name, os.environ.get(name))
                if warning:
                    logger.warning("%s", warning)
            raw = os.environ.get(PLUGINS_ENV)
            allow = None if raw is None else _names(raw)
            preference = () if raw is None else tuple(dict.fromkeys(p.strip() for p in raw.split(",") if p.strip()))
            load = LoadSettings(allow, not flags[DISABLE_AUTOLOAD_ENV], flags[STRICT_ENV], preference)
            lists = {name: _names(os.environ.get(name, "")) for name in NAME_LIST_ENV}
            platform = os.environ.get(PLATFORM_ENV, "").strip()
            _current = Settings(load, platform, MappingProxyType(flags), MappingProxyType(lists))
        return _current


def env_flag(name: str) -> bool:
    """Whether the boolean variable ``name`` (one of :data:`BOOLEAN_ENV`) was set to a true value."""
    return current().flags[name]


def _reset_for_tests() -> None:
    """Forget the settings read, so the next :func:`current` reads the environment again (tests only)."""
    global _current
    with _lock:
        _current = None
