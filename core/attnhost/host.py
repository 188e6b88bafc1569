"""The process-wide plugin host: it owns every step of entry points → plugin manager → registry → frozen, behind one
lock, so threads, forks and repeated calls all see plugins loaded exactly once per process."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterable, Iterator

import pluggy

from attnhost import entry_points, settings
from attnhost.discovery import (
    ENTRY_POINT_GROUP,
    GuardedPluginManager,
    PluginInfo,
    PluginStatus,
    load_entry_points,
    register_checked,
)
from attnhost.errors import (
    AttnhostError,
    InvalidPluginError,
    PluginLoadError,
    PluginProblem,
    RegistryFrozenError,
    bounded,
    describe_exception,
    one_line,
    printable,
    printable_record,
)
from attnhost.hooks import hookimpl
from attnhost.registry import Registry, build_registry, collect_contributions
from attnhost.settings import NO_CACHE_ENV, PLUGINS_ENV, STRICT_ENV, LoadSettings, env_flag
from attnhost.spec import BackendSpec, check_backend_name

__all__ = ["PluginHost", "default_host", "engine_load_failure", "get_plugin_manager", "get_registry"]
__all__ += ["register_plugin"]

logger = logging.getLogger(__name__)
logger.addFilter(printable_record)  # plugin text in a log line is escaped


class _DeclaredNames:
    """The in-process plugin behind ``add_attention_backend_choices`` and friends."""

    NAME = "<add_attention_backend_choices>"  # no entry point can plausibly take it

    def __init__(self) -> None:
        # dicts as ordered sets: adding n names one call at a time stays linear
        self.target: dict[str, None] = {}
        self.draft: dict[str, None] = {}

    @hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        names = {**self.target, **self.draft}
        return [BackendSpec(name=name, description="declared in-process by name only") for name in names]

    @hookimpl
    def attnhost_draft_attention_backends(self) -> list[str]:
        return list(self.draft)


class PluginHost:
    """Owns the plugin manager, the registry built from it, and the freeze."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm: GuardedPluginManager | None = None
        self._loading: GuardedPluginManager | None = None  # being filled by entry points; re-entrant calls get it
        self._building = False
        self._discovered: list[PluginInfo] = []
        self._in_process: dict[str, PluginInfo] = {}
        self._declared = _DeclaredNames()
        self._registry: Registry | None = None
        self._plugins: tuple[PluginInfo, ...] = ()
        self._strict_error: PluginLoadError | None = None
        self._logged: set[str] = set()  # registry warnings logged: a rebuild before the freeze must not repeat them
        self._frozen_by: str | None = None  # ``the first ServerArgs``, ...: named in every late registration's error

    def plugin_manager(self) -> pluggy.PluginManager:
        """The pluggy manager, with every allowed entry point loaded (once per process)."""
        if self._pm is not None:
            return self._pm
        with self._lock:
            # a plugin's import-time code calling back (SGLang-style add_*_choices) gets the manager being filled
            if (pm := self._pm or self._loading) is not None:
                return pm
            pm = self._loading = GuardedPluginManager(self._change)
            load = LoadSettings.from_env()  # read before any plugin code runs, kept for the process
            try:
                records = _scan()
                self._discovered = load_entry_points(pm, records, load)
            finally:
                self._loading = None
            self._pm = pm
            return pm

    @contextlib.contextmanager
    def _change(self, what: str) -> Iterator[None]:
        """Guard one change to the plugin set: under the lock freezing takes (so a registration racing the first
        ``ServerArgs`` lands in the frozen registry or raises), refused once frozen, the registry stale after."""
        with self._lock:
            self._check(what)
            try:
                yield
            finally:
                self._registry = None

    def registry(self) -> Registry:
        """The current registry; raises ``PluginLoadError`` under ``ATTNHOST_STRICT=1`` if a plugin failed."""
        registry = self._registry
        if registry is None:
            with self._lock:
                self._check("the backend registry was requested", change=False)
                registry = self._build() if self._registry is None else self._registry
        if self._strict_error is not None:
            raise self._strict_error
        return registry

    def _build(self) -> Registry:
        pm = self.plugin_manager()
        registered = dict(pm.list_name_plugin())
        known = {info.name for info in self._discovered if info.status is PluginStatus.LOADED}
        records = self._discovered + [
            self._in_process.get(name) or _in_process_info(name, plugin)
            for name, plugin in registered.items()
            if name not in known and plugin is not None
        ]
        # An in-process plugin whose hook failed was unregistered (below); a rebuild reports it the same way.
        records += [i for n, i in self._in_process.items() if i.status is PluginStatus.FAILED and n not in registered]
        load = LoadSettings.from_env()
        self._building = True
        try:
            with _quiet(logging.getLogger(collect_contributions.__module__), load.strict):
                contributions = collect_contributions(pm, records)
        finally:
            self._building = False
        registry, plugins = build_registry(contributions)
        # A plugin whose hook failed leaves the manager (no later hook call asks it); its failure replaces its record
        for before, after in zip(records, plugins, strict=True):
            if before.status is not PluginStatus.LOADED or after.status is not PluginStatus.FAILED:
                continue
            pm.unregister(name=after.name)
            if before in self._discovered:
                self._discovered[self._discovered.index(before)] = after
            elif after.name in self._in_process:
                self._in_process[after.name] = after
        for warning in [warning for info in plugins for warning in info.warnings]:
            if warning not in self._logged and not load.strict:  # strict: the one error below says each
                self._logged.add(warning)
                logger.warning("%s", warning)
        bad = (PluginStatus.FAILED, PluginStatus.DUPLICATE)
        parts = [f"{info.origin}: {info.error}" for info in plugins if info.status in bad]
        parts += [f"{info.origin}: {warning}" for info in plugins for warning in info.warnings]
        found = sorted(info.name for info in self._discovered)
        missing = sorted((load.allow or frozenset()).difference(found))
        parts += [
            f"{PLUGINS_ENV} names plugin {bounded(repr(name))}, which is not installed{_close(name, found)}"
            for name in missing[:5]
        ]
        parts += [f"and {len(missing) - 5} more names of {PLUGINS_ENV}"] if len(missing) > 5 else []
        self._strict_error = None
        if load.strict and parts:  # plugin text (errors, distribution names) in an error message is escaped
            self._strict_error = PluginLoadError(
                f"{STRICT_ENV}=1 and {len(parts)} plugin problem(s): "
                + "; ".join(printable(part) for part in parts)
                + f" — fix or uninstall them, or unset {STRICT_ENV}"
            )
        self._plugins = tuple(plugins)
        self._registry = registry
        return registry

    def plugins(self) -> tuple[PluginInfo, ...]:
        """Every discovered or registered plugin with its status, in registration order."""
        if self._registry is None:
            with contextlib.suppress(PluginLoadError):
                self.registry()
        return self._plugins

    def freeze(self, by: str = "the first ServerArgs") -> Registry:
        """Freeze the registry (idempotent): every later registration raises, naming the first freeze's ``by``."""
        with self._lock:
            registry = self.registry()
            self._frozen_by = self._frozen_by or by
            return registry

    def _check(self, what: str, *, change: bool = True) -> None:
        """Refuse a change to the plugin set once frozen, and what a plugin calling back may not do mid-load (read
        the registry: it is not complete) or mid-build (anything): failing that plugin beats recursing."""
        if self._loading is not None and not change:
            raise AttnhostError(
                f"{what} while plugins are still being imported (by a plugin's import-time code); "
                "read it after start-up, not when the plugin module is imported"
            )
        if self._building:
            raise AttnhostError(
                f"{what} from inside a plugin hook while the registry is being built from those hooks; "
                "a hook must only return its answer"
            )
        if change and self._frozen_by is not None:
            raise RegistryFrozenError(
                f"{what} came after {self._frozen_by} froze the backend registry; declare it from a "
                f"plugin entry point (group {ENTRY_POINT_GROUP!r}) or do it before building ServerArgs "
                "or an argument parser"
            )

    def add_choices(self, names: Iterable[str], *, draft: bool) -> None:
        """SGLang's ``add_*_attention_backend_choices``: name-only additions, before the freeze."""
        names = [names] if isinstance(names, str) else list(names)
        function = "add_draft_attention_backend_choices" if draft else "add_attention_backend_choices"
        with self._change(f"{function}({names!r})"):
            for name in names:
                check_backend_name(name)
            pm = self.plugin_manager()
            (self._declared.draft if draft else self._declared.target).update(dict.fromkeys(names))
            if not pm.is_registered(self._declared):
                pm.register(self._declared, name=_DeclaredNames.NAME)

    def register_plugin(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object (or ``AttentionBackend`` subclass) in-process, before the freeze."""
        label = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        with self._change(f"registering plugin {label!r}"):
            pm = self.plugin_manager()
            if pm.has_plugin(label):
                raise ValueError(f"a plugin named {label!r} is already registered; pass another name=")
            try:
                register_checked(pm, plugin, label)
            except PluginProblem as problem:
                raise InvalidPluginError(f"plugin {label!r} {problem}") from None
            self._in_process[label] = _in_process_info(label, plugin)
            return label

    def _after_fork_in_child(self) -> None:
        # The lock may be held by a thread that is not here; mid-load or mid-build, start that step over
        self._lock = threading.RLock()
        if self._loading is not None or self._building:
            self._loading = None
            self._building = False
            self._registry = None


def _scan() -> tuple[entry_points.EntryPointRecord, ...]:
    """The installed entry points; a module missing for the scan is a broken install (``pip install --no-deps``),
    said as such with the way out, not as an internal error or an engine's later "invalid backend"."""
    try:
        return entry_points.scan(ENTRY_POINT_GROUP, use_cache=not env_flag(NO_CACHE_ENV))
    except ImportError as exc:
        raise AttnhostError(
            f"attnhost cannot look up installed plugins: {describe_exception(exc)}; a dependency of attnhost is "
            f"missing (as after `pip install --no-deps`): {_install_hint(exc.name or '')}"
        ) from exc


def _install_hint(module: str) -> str:
    """``pip install REQUIREMENT`` for the attnhost requirement that provides ``module``, as attnhost's metadata
    spells it (``importlib_metadata`` → ``'importlib-metadata>=8'``); else: reinstall attnhost."""
    import importlib.metadata  # the standard library's: the missing module may be the backport
    import re

    try:
        requirements = importlib.metadata.requires("attnhost") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        requirements = []
    for requirement in requirements:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        if ";" not in requirement and module and name.replace("-", "_").lower() == module.lower():
            return f"pip install '{requirement.strip()}', or reinstall attnhost with its dependencies"
    return "reinstall attnhost with its dependencies (pip install --force-reinstall attnhost)"


def engine_load_failure(engine: str, exc: BaseException) -> str:
    """The one error line an engine bridge logs when attnhost cannot register its backends in an engine process:
    without it, the engine's own message comes later and says only that the backend name is invalid."""
    import multiprocessing

    process = multiprocessing.current_process().name
    cause = str(exc) if isinstance(exc, AttnhostError) else describe_exception(exc)
    fix = "" if isinstance(exc, AttnhostError) else f" (reinstall attnhost, or report it; {engine} logs the traceback)"
    return (
        f"attnhost could not register its attention backends with {engine} in this process ({process}, pid "
        f"{os.getpid()}), so {engine} cannot use them here: {printable(one_line(cause))}{fix}"
    )


def _close(name: str, found: list[str]) -> str:
    import difflib  # only for a strict-mode error

    close = difflib.get_close_matches(name, found, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@contextlib.contextmanager
def _quiet(log: logging.Logger, strict: bool) -> Iterator[None]:
    """Under ``ATTNHOST_STRICT=1``, hold back ``log``'s warnings: each plugin problem is printed once, in the host's
    error, not also as a warning before it."""
    if not strict:
        yield
        return
    log.addFilter(_drop_warnings)
    try:
        yield
    finally:
        log.removeFilter(_drop_warnings)


def _drop_warnings(record: logging.LogRecord) -> bool:
    return record.levelno != logging.WARNING


def _in_process_info(name: str, plugin: object) -> PluginInfo:
    module = getattr(plugin, "__module__", None) or type(plugin).__module__
    qualname = getattr(plugin, "__qualname__", None) or type(plugin).__qualname__
    value = plugin.__name__ if isinstance(plugin, type(sys)) else f"{module}:{qualname}"
    return PluginInfo(name=name, distribution=None, version=None, value=value, status=PluginStatus.LOADED)


_DEFAULT = PluginHost()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _DEFAULT._after_fork_in_child())


def default_host() -> PluginHost:
    """The host every public function uses."""
    return _DEFAULT


def get_registry() -> Registry:
    """The backend registry, loading plugins on first use."""
    return _DEFAULT.registry()


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager, loading plugins on first use (registering on it after the freeze raises)."""
    return _DEFAULT.plugin_manager()


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object or ``AttentionBackend`` subclass in-process, before the first ``ServerArgs``."""
    return _DEFAULT.register_plugin(plugin, name)


def _reset_for_tests() -> None:
    """Forget every plugin, the freeze and the settings read; for attnhost's own test-suite only."""
    settings._reset_for_tests()
    _DEFAULT.__init__()  # type: ignore[misc]
