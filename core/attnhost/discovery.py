"""Turn installed entry points into registered pluggy plugins, one verdict (:class:`PluginInfo`) per plugin: a plugin
is other people's code running at start-up, so nothing it does here escapes as an exception; it becomes a ``failed``
record and one warning line naming the plugin, its distribution and the cause."""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import pluggy

from attnhost.entry_points import EntryPointRecord, normalize_name
from attnhost.errors import (
    PluginLoadInterrupted,
    PluginProblem,
    bounded,
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

__all__ = ["BUILTIN_MODULE", "BUILTIN_PLUGIN", "ENTRY_POINT_GROUP", "SLOW_IMPORT_WARNING_S", "GuardedPluginManager"]
__all__ += ["PluginInfo", "PluginStatus", "load_entry_points", "register_checked", "way_out"]

if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend

logger = logging.getLogger(__name__)
logger.addFilter(printable_record)  # plugin text in a log line is escaped

ENTRY_POINT_GROUP = "sglang.draft_attention_backends"
BUILTIN_PLUGIN = "builtin"  # attnhost's own entry point: builtin = attnhost_builtin
BUILTIN_MODULE = "attnhost_builtin"
MAX_NAMED = 5  # unknown ATTNHOST_PLUGINS names warned about one by one; the rest are counted
SLOW_IMPORT_WARNING_S = 10.0
"""How long a plugin's import may run before one warning names it; the host keeps waiting either way."""
_PACKAGE: Any = sys.modules[__name__.rpartition(".")[0]]  # attnhost itself: its parent, not re-imported (layers)


class PluginStatus(enum.StrEnum):
    """What became of one discovered plugin."""

    LOADED = "loaded"
    FAILED = "failed"
    BLOCKED = "blocked"  # not imported: ATTNHOST_DISABLE_PLUGIN_AUTOLOAD is set
    NOT_ALLOWED = "not-allowed"  # not imported: ATTNHOST_PLUGINS does not name it
    DUPLICATE = "duplicate"  # not imported: another distribution's entry point already has this plugin name


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

    @property
    def origin(self) -> str:
        """``plugin 'x' (distribution y 1.0)``: how every message names a plugin."""
        return plugin_label(self.name, self.distribution, self.version)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # json writes the status as its value and the tuples as lists


class ShorthandPlugin:
    """An entry point naming an ``AttentionBackend`` subclass: a target and draft backend of that name."""

    def __init__(self, name: str, backend_class: type[AttentionBackend]) -> None:
        self.name = check_backend_name(name, "entry point name (the shorthand's backend name)")
        self.backend_class = backend_class
        doc = inspect.cleandoc(vars(backend_class).get("__doc__") or "")  # its own: a base's describes no backend
        self.description = doc.splitlines()[0] if doc else ""

    @hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=self.name, factory=self.backend_class, description=self.description)]

    @hookimpl
    def attnhost_draft_attention_backends(self) -> list[str]:
        return [self.name]


class GuardedPluginManager(pluggy.PluginManager):
    """A pluggy manager whose every change to the plugin set goes through the host's guard (refused once frozen)."""

    def __init__(self, guard: Callable[[str], contextlib.AbstractContextManager[object]]) -> None:
        super().__init__(PROJECT_NAME)
        self._guard = guard
        self.add_hookspecs(AttnhostHookSpecs)

    def _label(self, plugin: object | None, name: str | None) -> str:
        return printable(repr(name or self.get_canonical_name(plugin)))

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


def register_checked(pm: pluggy.PluginManager, obj: object, name: str) -> None:
    """Register ``obj`` (a backend class as a :class:`ShorthandPlugin`) or raise :class:`PluginProblem`, pm untouched:
    also what ``check_pending`` would only catch globally (unknown hooks: typos), wrappers, and no hook at all."""
    # Looked up, not imported: until something imports attnhost.backend, nothing can be one of its subclasses
    base: type[AttentionBackend] | None = getattr(sys.modules.get("attnhost.backend"), "AttentionBackend", None)
    plugin = obj
    if base is not None and inspect.isclass(obj) and issubclass(obj, base):
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
            raise PluginProblem(f"the backend class {obj.__qualname__} is abstract (does not implement {missing})")
        plugin = ShorthandPlugin(name, obj)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        pm.unregister(name=name)  # pluggy has registered the name before it validated the hooks
        # pluggy's message spans lines ("Plugin X for hook Y", the definition, the cause): keep all, on one line.
        detail = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise PluginProblem(f"has an invalid hook implementation: {detail}") from None
    callers = pm.get_hookcallers(plugin) or []
    unknown = sorted(caller.name for caller in callers if not caller.has_spec())
    wrappers = sorted(
        caller.name
        for caller in callers
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper)
    )
    if unknown or wrappers or not callers:
        pm.unregister(name=name)
    if unknown:
        import difflib  # only on this error path

        close = difflib.get_close_matches(unknown[0], HOOK_NAMES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PluginProblem(f"implements unknown hook {unknown[0]!r}; {hint}known hooks: {', '.join(HOOK_NAMES)}")
    if wrappers:
        raise PluginProblem(
            f"implements {wrappers[0]} as a wrapper; attnhost asks every plugin for its own answer "
            "(to name who gave it), so implement it as a plain @attnhost.hookimpl"
        )
    if not callers:
        undecorated = [n for n in dir(plugin) if n.startswith("attnhost_") and callable(getattr(plugin, n, None))]
        if undecorated:
            raise PluginProblem(
                f"defines {', '.join(undecorated)} without the @attnhost.hookimpl decorator, so it implements no hook"
            )
        raise PluginProblem(
            f"its entry point object ({type(plugin).__name__} {safe_repr(plugin)}) is neither an "
            "attnhost.AttentionBackend subclass nor a plugin with @attnhost.hookimpl functions"
        )


def _info(record: EntryPointRecord, builtin: bool = False) -> PluginInfo:
    dist = record.distribution or f"{record.source or record.location} (no Name in METADATA)"  # not "in-process"
    return PluginInfo(record.name, dist, record.version, record.value, PluginStatus.LOADED, builtin=builtin)


def _fail(info: PluginInfo, cause: str, *, strict: bool) -> PluginInfo:
    failed = replace(info, status=PluginStatus.FAILED, error=one_line(cause))
    if not strict:  # under ATTNHOST_STRICT=1 the host's one error names it: a warning too would say it twice
        logger.warning("%s failed to load: %s; %s", failed.origin, failed.error, way_out(failed))
    return failed


def way_out(info: PluginInfo) -> str:
    """What an operator can do about a broken plugin, ending every warning about one."""
    if info.builtin:
        return "reinstall attnhost"
    if info.distribution is None:
        return "fix the code that registers it"
    return f"fix or uninstall {info.distribution}, or leave it out with {PLUGINS_ENV}"


def load_entry_points(
    pm: pluggy.PluginManager, records: Sequence[EntryPointRecord], settings: LoadSettings
) -> list[PluginInfo]:
    """Register the built-in, then import and register the entry points the settings allow; every plugin found. The
    built-in is attnhost's own code: registered first under every setting, as the attnhost imported here, whatever
    metadata claims its name. An entry point naming its very module (a stale egg-info, a second install) is that same
    declaration: nothing to load or report; any other named ``builtin`` is a collision."""
    own = EntryPointRecord(BUILTIN_PLUGIN, BUILTIN_MODULE, ENTRY_POINT_GROUP, "attnhost", _PACKAGE.__version__, "")
    taken = {BUILTIN_PLUGIN: _load_one(pm, own, _info(own, builtin=True), strict=settings.strict)}
    plugins = [taken[BUILTIN_PLUGIN]]
    others = [r for r in records if (r.name, r.value) != (BUILTIN_PLUGIN, BUILTIN_MODULE)]
    rank = {name: i for i, name in enumerate(settings.preference)}  # ATTNHOST_PLUGINS's order first, then by name
    for record in sorted(others, key=lambda r: (rank.get(r.name, len(rank)), r.name, normalize_name(r.distribution))):
        info = _info(record)
        if record.name in taken:
            owner = taken[record.name]
            holder = "attnhost's built-in plugin" if owner.builtin else f"distribution {owner.distribution}"
            error = f"plugin name {record.name!r} is already taken by {holder}"
            info = replace(info, status=PluginStatus.DUPLICATE, error=error)
            fix = "rename one of the entry points or uninstall one distribution"
            if not settings.strict:  # the strict-mode error names it
                logger.warning("%s was not loaded: %s; %s", info.origin, error, fix)
        elif not settings.autoload:
            info = replace(info, status=PluginStatus.BLOCKED, error=f"{DISABLE_AUTOLOAD_ENV} is set")
        elif settings.allow is not None and record.name not in settings.allow:
            info = replace(info, status=PluginStatus.NOT_ALLOWED, error=f"not named in {PLUGINS_ENV}")
        else:
            info = taken[record.name] = _load_one(pm, record, info, strict=settings.strict)
        plugins.append(info)
    if settings.allow is None or settings.strict:  # strict: the host's error names the missing ones
        return plugins
    import difflib  # only on this warning's path

    found = sorted({record.name for record in records} | {BUILTIN_PLUGIN})
    unknown = sorted(settings.allow.difference(found))
    for name in unknown[:MAX_NAMED]:  # the logger escapes plugin text in the names
        close = difflib.get_close_matches(name, found, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "check the spelling or install it"
        message = "%s names plugin %s, which is not installed; %s (installed plugins: %s)"
        logger.warning(message, PLUGINS_ENV, bounded(repr(name)), hint, bounded(", ".join(found), 1000))
    if len(unknown) > MAX_NAMED:
        logger.warning("%s names %d more plugins that are not installed", PLUGINS_ENV, len(unknown) - MAX_NAMED)
    return plugins


class _SlowImportWatch:
    """A thread that names the plugin whose import runs past :data:`SLOW_IMPORT_WARNING_S` (an import cannot be
    interrupted safely); one serves every import of a load, and ends when idle for a second."""

    def __init__(self) -> None:
        # Also the reset in a forked child, where the lock may have been held and the thread is gone.
        self._cond = threading.Condition()
        self._current: tuple[str, ...] = ()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def importing(self, what: str) -> Iterator[None]:
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
                self._current = ()
                self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while self._cond.wait_for(lambda: self._current, timeout=1.0):
                current = self._current  # the predicates below are called within this iteration
                if not self._cond.wait_for(lambda: self._current is not current, SLOW_IMPORT_WARNING_S):  # noqa: B023
                    logger.warning("%s", current[0])
                    self._cond.wait_for(lambda: self._current is not current)  # noqa: B023
            self._thread = None


_WATCH = _SlowImportWatch()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCH.__init__)  # type: ignore[misc]


def _load_one(pm: pluggy.PluginManager, record: EntryPointRecord, info: PluginInfo, *, strict: bool) -> PluginInfo:
    """Import and register one entry point: its prints go to stderr, a hang is named, Ctrl-C names the plugin; a
    failure is a warning, or under ``strict`` only the record (the host raises one error naming every failure)."""
    where = f"{info.origin} (entry point {printable(repr(record.value))})"
    slow = (
        f"still importing {where} after {SLOW_IMPORT_WARNING_S:g} s; waiting for it, since an import cannot be "
        f"stopped safely — if it hangs, {way_out(info)}"
    )
    try:
        with _WATCH.importing(slow), plugin_output():
            obj = record.load()
    except KeyboardInterrupt:
        raise PluginLoadInterrupted(f"interrupted while importing {where}") from None
    except (Exception, SystemExit) as exc:
        return _fail(info, f"importing {record.value!r} raised {describe_exception(exc)}", strict=strict)
    try:
        register_checked(pm, obj, record.name)
    except (PluginProblem, ValueError) as exc:  # ValueError: an invalid shorthand name, or a duplicate object
        return _fail(info, str(exc), strict=strict)
    except (Exception, SystemExit) as exc:  # e.g. an object whose attribute access raises while pluggy scans it
        pm.unregister(name=record.name)  # a no-op unless pluggy had registered it
        return _fail(info, f"registering its entry point object raised {describe_exception(exc)}", strict=strict)
    return info
