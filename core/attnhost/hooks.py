"""The pluggy hook specifications: the whole surface a plugin can implement (the spec marker stays private). It
imports pluggy, so ``attnhost/__init__`` exposes ``hookimpl`` lazily: a process that loads no plugin never pays."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pluggy

from attnhost.spec import BackendSpec

__all__ = ["HOOK_NAMES", "PROJECT_NAME", "AttnhostHookSpecs", "call_plugin_hook", "hookimpl", "plugin_output"]

PROJECT_NAME = "attnhost"

_hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class AttnhostHookSpecs:
    """Hooks a plugin may implement (decorate module functions with ``@attnhost.hookimpl``)."""

    @_hookspec
    def attnhost_attention_backends(self) -> Sequence[BackendSpec]:
        """Return the attention backends this plugin provides (all usable by target models)."""
        raise NotImplementedError

    @_hookspec
    def attnhost_draft_attention_backends(self) -> Sequence[str]:
        """Return the names (of any plugin's backends) that speculative draft workers may use."""
        raise NotImplementedError

    @_hookspec(firstresult=True)
    def attnhost_draft_fallback(self, platform: str) -> str | None:
        """Return the draft backend to fall back to on ``platform``, or None to let others answer. The built-in plugin
        answers last: ``triton`` on ROCm, ``flashinfer`` elsewhere."""
        raise NotImplementedError

    @_hookspec(firstresult=True)
    def attnhost_default_attention_backend(self, platform: str) -> str | None:
        """Return the target backend to use on ``platform`` when no flag names one, or None."""
        raise NotImplementedError


HOOK_NAMES: tuple[str, ...] = tuple(name for name in vars(AttnhostHookSpecs) if name.startswith("attnhost_"))


def call_plugin_hook(pm: pluggy.PluginManager, hook_name: str, plugin_name: str, default: Any, **kwargs: Any) -> Any:
    """One plugin's answer to a hook (``None`` included), or ``default`` if it does not implement the hook. One plugin
    at a time, so that an exception or a bad answer is blamed on that plugin alone and the trace can say who answered;
    called as pluggy calls it, with the subset of the hook's arguments it takes."""
    plugin = pm.get_plugin(plugin_name)
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    impl = next((i for i in impls if i.plugin is plugin and not (i.wrapper or i.hookwrapper)), None)
    if impl is None:
        return default
    with plugin_output():
        return impl.function(*(kwargs[name] for name in impl.argnames))


class _PluginStdout:
    """``sys.stdout`` while plugin code runs: the plugin's thread writes to stderr, every other thread to stdout."""

    def __init__(self, stdout: Any) -> None:
        self._stdout = stdout  # its own reference: a proxy a plugin kept and reinstalled still resolves

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stderr if getattr(_in_plugin, "depth", 0) else self._stdout, name)


_in_plugin = threading.local()
_stdout_lock = threading.Lock()
_stdout_users = 0
_saved_stdout: Any = None


@contextlib.contextmanager
def plugin_output() -> Iterator[None]:
    """Run plugin code (an import, a hook, a factory's import) with what it prints sent to stderr. stdout is the
    program's own output (``attnhost list --json`` must stay valid JSON). Unlike ``contextlib.redirect_stdout`` this is
    safe across threads, and the last of nested or overlapping uses restores the real stdout (undoing any replacement a
    plugin made)."""
    global _stdout_users, _saved_stdout
    _in_plugin.depth = getattr(_in_plugin, "depth", 0) + 1
    with _stdout_lock:
        if _stdout_users == 0:
            _saved_stdout = sys.stdout
            sys.stdout = _PluginStdout(_saved_stdout)
        _stdout_users += 1
    try:
        yield
    finally:
        with _stdout_lock:
            _stdout_users -= 1
            if _stdout_users == 0:
                sys.stdout = _saved_stdout
        _in_plugin.depth -= 1
