"""Turn installed entry points into registered pluggy plugins, one verdict per plugin.

Every entry point ends in exactly one :class:`PluginInfo`: loaded, or the
reason it is not (failed, blocked, not allowed, duplicate). A plugin is other
people's code running at start-up, so nothing a plugin does here may escape
as an exception: it becomes a ``failed`` record and one warning line naming
the plugin, its distribution and the cause.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pluggy

from attnhost.entry_points import EntryPointRecord, normalize_name
from attnhost.errors import (
    PluginLoadInterrupted,
    PluginProblem,
    describe_exception,
    one_line,
    plugin_label,
    printable,
    printable_record,
    safe_repr,
)
from attnhost.hooks import HOOK_NAMES, PROJECT_NAME, AttnhostHookSpecs, hookimpl, plugin_output
from attnhost.settings import DISABLE_AUTOLOAD_ENV, PLUGINS_ENV, LoadSettings
from attnhost.spec import BackendSpec, check_backend_name

__all__ = [
    "BUILTIN_DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "SLOW_IMPORT_WARNING_S",
    "GuardedPluginManager",
    "PluginInfo",
    "PluginStatus",
    "ShorthandPlugin",
    "load_entry_points",
    "register_checked",
    "way_out",
]

if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend

logger = logging.getLogger(__name__)
logger.addFilter(printable_record)  # plugin text in a log line is escaped

ENTRY_POINT_GROUP = "sglang.draft_attention_backends"
BUILTIN_DISTRIBUTION = "attnhost"
SLOW_IMPORT_WARNING_S = 10.0
"""How long a plugin's import may run before one warning names it; the host keeps waiting either way."""


class PluginStatus(enum.StrEnum):
    """What became of one discovered plugin."""

    LOADED = "loaded"
    FAILED = "failed"
    BLOCKED = "blocked"
    """Not imported: ``ATTNHOST_DISABLE_PLUGIN_AUTOLOAD`` is set."""
    NOT_ALLOWED = "not-allowed"
    """Not imported: ``ATTNHOST_PLUGINS`` does not name it."""
    DUPLICATE = "duplicate"
    """Not imported: another distribution's entry point already has this plugin name."""


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One plugin as the host sees it: where it came from and what became of it."""

    name: str
    distribution: str | None
    version: str | None
    value: str
    status: PluginStatus
    error: str | None = None
    backends: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    builtin: bool = False
    location: str | None = None

    @property
    def origin(self) -> str:
        """``plugin 'x' (distribution y 1.0)``: how every message names a plugin."""
        return plugin_label(self.name, self.distribution, self.version)

    def to_json(self) -> dict[str, Any]:
        """What ``--json`` shows: every field but the path entry it was found on."""
        fields = ("name", "distribution", "version", "value", "status", "error", "backends", "warnings", "builtin")
        out: dict[str, Any] = {name: getattr(self, name) for name in fields}
        out.update(status=self.status.value, backends=list(self.backends), warnings=list(self.warnings))
        return out


class ShorthandPlugin:
    """The one-line form: an entry point naming an ``AttentionBackend`` subclass.

    It becomes a target- and draft-capable backend named after the entry point;
    the class is its own factory, and its docstring's first line its description.
    """

    def __init__(self, name: str, backend_class: type[AttentionBackend]) -> None:
        self.name = check_backend_name(name, "entry point name (the shorthand's backend name)")
        self.backend_class = backend_class
        doc = inspect.getdoc(backend_class) or ""
        self.description = doc.strip().splitlines()[0] if doc.strip() else ""

    def __repr__(self) -> str:
        return f"<ShorthandPlugin {self.name!r}: {self.backend_class.__module__}.{self.backend_class.__qualname__}>"

    @hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=self.name, factory=self.backend_class, description=self.description)]

    @hookimpl
    def attnhost_draft_attention_backends(self) -> list[str]:
        return [self.name]


def as_plugin(name: str, obj: object) -> object:
    """Wrap an ``AttentionBackend`` subclass as a shorthand plugin; anything else is taken as-is."""
    # Looked up, not imported: until some module imports attnhost.backend, no object can be
    # one of its subclasses, and discovery need not pay for importing it.
    backend_module = sys.modules.get("attnhost.backend")
    base: type[AttentionBackend] | None = getattr(backend_module, "AttentionBackend", None)
    if base is not None and inspect.isclass(obj) and issubclass(obj, base):
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
            raise PluginProblem(f"the backend class {obj.__qualname__} is abstract (does not implement {missing})")
        return ShorthandPlugin(name, obj)
    return obj


class GuardedPluginManager(pluggy.PluginManager):
    """A pluggy manager whose every change to the plugin set goes through the host's guard.

    SGLang's late registrations were silently ignored; here the guard takes
    the host's lock, refuses the change once the registry is frozen (raising
    ``RegistryFrozenError``), and marks the registry stale after it, so no
    thread can slip a plugin in between a freeze's check and its build.
    """

    def __init__(self, guard: Callable[[str], AbstractContextManager[object]]) -> None:
        super().__init__(PROJECT_NAME)
        self._guard = guard
        self.add_hookspecs(AttnhostHookSpecs)

    def _label(self, plugin: object | None, name: str | None) -> str:
        label = name if name is not None else self.get_canonical_name(plugin) if plugin is not None else "?"
        return printable(repr(label))

    def register(self, plugin: object, name: str | None = None) -> str | None:
        with self._guard(f"registering plugin {self._label(plugin, name)}"):
            return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any | None:
        with self._guard(f"unregistering plugin {self._label(plugin, name)}"):
            return super().unregister(plugin, name)

    def set_blocked(self, name: str) -> None:
        with self._guard(f"blocking plugin {self._label(None, name)}"):
            super().set_blocked(name)

    def unblock(self, name: str) -> bool:
        with self._guard(f"unblocking plugin {self._label(None, name)}"):
            return super().unblock(name)


def _unknown_hook_message(hook_name: str) -> str:
    import difflib  # only on this error path

    close = difflib.get_close_matches(hook_name, HOOK_NAMES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"implements unknown hook {hook_name!r}; {hint}known hooks: {', '.join(HOOK_NAMES)}"


def _undecorated_hooks(plugin: object) -> list[str]:
    names = [n for n in dir(plugin) if n.startswith("attnhost_")]
    return [n for n in names if callable(getattr(plugin, n, None))]


def register_checked(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin`` under ``name`` or raise :class:`PluginProblem`, leaving ``pm`` untouched.

    Besides pluggy's signature validation this rejects, per plugin, what
    ``check_pending`` would only catch globally: unknown hook names (typos)
    and objects that implement no hook at all.
    """
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        if pm.has_plugin(name):
            pm.unregister(name=name)
        # pluggy's message spans lines ("Plugin X for hook Y", the definition, the cause): keep all, on one line.
        detail = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise PluginProblem(f"has an invalid hook implementation: {detail}") from None
    callers = pm.get_hookcallers(plugin) or []
    unknown = sorted(caller.name for caller in callers if not caller.has_spec())
    if unknown:
        pm.unregister(name=name)
        raise PluginProblem(_unknown_hook_message(unknown[0]))
    wrappers = sorted(
        caller.name
        for caller in callers
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper)
    )
    if wrappers:
        pm.unregister(name=name)
        raise PluginProblem(
            f"implements {wrappers[0]} as a wrapper; attnhost asks every plugin for its own answer "
            "(to name who gave it), so implement it as a plain @attnhost.hookimpl"
        )
    if not callers:
        pm.unregister(name=name)
        undecorated = _undecorated_hooks(plugin)
        if undecorated:
            raise PluginProblem(
                f"defines {', '.join(undecorated)} without the @attnhost.hookimpl decorator, so it implements no hook"
            )
        raise PluginProblem(
            f"its entry point object ({type(plugin).__name__} {safe_repr(plugin)}) is neither an "
            "attnhost.AttentionBackend subclass nor a plugin with @attnhost.hookimpl functions"
        )


def _is_builtin(record: EntryPointRecord) -> bool:
    return normalize_name(record.distribution) == BUILTIN_DISTRIBUTION


def _info(record: EntryPointRecord, status: PluginStatus, error: str | None = None) -> PluginInfo:
    return PluginInfo(
        name=record.name,
        distribution=record.distribution,
        version=record.version,
        value=record.value,
        status=status,
        error=error,
        builtin=_is_builtin(record),
        location=record.location,
    )


def _fail(info: PluginInfo, cause: str) -> PluginInfo:
    failed = replace(info, status=PluginStatus.FAILED, error=one_line(cause))
    logger.warning("%s failed to load: %s; %s", failed.origin, failed.error, way_out(failed))
    return failed


def way_out(info: PluginInfo) -> str:
    """What an operator can do about a broken plugin, ending every warning about one."""
    if info.builtin:
        return "reinstall attnhost"
    if info.distribution is None:
        return "fix the code that registers it"
    return f"fix or uninstall {info.distribution}, or leave it out with {PLUGINS_ENV}"


@dataclass
class DiscoveryResult:
    """The plugins found, in registration order (built-ins first, then by name)."""

    plugins: list[PluginInfo] = field(default_factory=list)
    missing_allowed: tuple[str, ...] = ()


def load_entry_points(
    pm: pluggy.PluginManager, records: Sequence[EntryPointRecord], settings: LoadSettings
) -> DiscoveryResult:
    """Import and register the entry points the settings allow; never raises for a plugin's fault."""
    ordered = sorted(records, key=lambda r: (not _is_builtin(r), r.name, normalize_name(r.distribution)))
    result = DiscoveryResult()
    taken: dict[str, PluginInfo] = {}
    for record in ordered:
        info = _info(record, PluginStatus.LOADED)
        if record.name in taken:
            owner = taken[record.name]
            info = replace(
                info,
                status=PluginStatus.DUPLICATE,
                error=f"plugin name {record.name!r} is already taken by distribution {owner.distribution}",
            )
            logger.warning(
                "%s was not loaded: %s; rename one of the entry points or uninstall one distribution",
                info.origin,
                info.error,
            )
        elif not info.builtin and not settings.autoload:
            info = replace(info, status=PluginStatus.BLOCKED, error=f"{DISABLE_AUTOLOAD_ENV} is set")
        elif not info.builtin and settings.allow is not None and record.name not in settings.allow:
            info = replace(info, status=PluginStatus.NOT_ALLOWED, error=f"not named in {PLUGINS_ENV}")
        else:
            info = _load_one(pm, record, info)
            taken[record.name] = info
        result.plugins.append(info)
    if settings.allow is not None:
        found = {record.name for record in records}
        missing = tuple(sorted(settings.allow - found))
        for name in missing:
            logger.warning("%s", _not_installed_message(name, found))
        result.missing_allowed = missing
    return result


def _not_installed_message(name: str, installed: set[str]) -> str:
    """``ATTNHOST_PLUGINS names plugin 'x', which is not installed; did you mean 'y'? ...``"""
    import difflib  # only on this warning's path

    close = difflib.get_close_matches(name, sorted(installed), n=1)
    hint = f"did you mean {printable(repr(close[0]))}?" if close else "check the spelling or install it"
    return (
        f"{PLUGINS_ENV} names plugin {printable(repr(name))}, which is not installed; {hint} "
        f"(installed plugins: {printable(', '.join(sorted(installed))) or 'none'})"
    )


class _SlowImportWatch:
    """A watcher thread that names the plugin whose import runs past :data:`SLOW_IMPORT_WARNING_S`.

    An import cannot be interrupted safely, so the host only says which
    plugin it is waiting for (once per import) and goes on waiting. One
    thread serves every import of a load (most loads import many plugins
    and none of them is slow) and ends once no import has started for a
    while; the next import starts another.
    """

    _IDLE_S = 1.0

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Fresh state (also in a forked child, where the lock may have been held and the thread is gone)."""
        self._cond = threading.Condition()
        self._current: tuple[str] | None = None
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def importing(self, what: str) -> Iterator[None]:
        """Watch the import run inside the ``with`` block; ``what`` is the warning if it runs long."""
        with self._cond:
            self._current = (what,)  # a fresh tuple per import: the watcher compares identities
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="attnhost-slow-import", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._current = None
                self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                current = self._current
                if current is None:
                    if not self._cond.wait(self._IDLE_S) and self._current is None:
                        self._thread = None
                        return
                    continue
                deadline = time.monotonic() + SLOW_IMPORT_WARNING_S
                while self._current is current:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        logger.warning("%s", current[0])
                        while self._current is current:
                            self._cond.wait()
                        break
                    self._cond.wait(remaining)


_WATCH = _SlowImportWatch()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCH._reset)


def _import(record: EntryPointRecord, info: PluginInfo) -> object:
    """Import the entry point's object: its prints go to stderr, a hang is named, Ctrl-C names the plugin."""
    slow = (
        f"still importing {info.origin} (entry point {printable(repr(record.value))}) after "
        f"{SLOW_IMPORT_WARNING_S:g} s; waiting for it, since an import cannot be stopped safely — if it hangs, "
        f"{way_out(info)}"
    )
    try:
        with _WATCH.importing(slow), plugin_output():
            return record.load()
    except KeyboardInterrupt:
        raise PluginLoadInterrupted(
            f"interrupted while importing {info.origin} (entry point {printable(repr(record.value))})"
        ) from None


def _load_one(pm: pluggy.PluginManager, record: EntryPointRecord, info: PluginInfo) -> PluginInfo:
    try:
        obj = _import(record, info)
    except (Exception, SystemExit) as exc:
        return _fail(info, f"importing {record.value!r} raised {describe_exception(exc)}")
    try:
        register_checked(pm, as_plugin(record.name, obj), record.name)
    except PluginProblem as problem:
        return _fail(info, str(problem))
    except ValueError as exc:  # invalid shorthand name, or pluggy refusing a duplicate object
        return _fail(info, str(exc))
    except (Exception, SystemExit) as exc:  # e.g. an object whose attribute access raises while pluggy scans it
        if pm.has_plugin(record.name):
            pm.unregister(name=record.name)
        return _fail(info, f"registering its entry point object raised {describe_exception(exc)}")
    return info
