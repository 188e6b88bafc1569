"""The registry: every backend name, its aliases, roles and provenance, rebuilt on each registration before the
freeze and never changed after it; outside code sees only read-only views, so nobody can corrupt it the way SGLang's
module-level lists could be."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

import pluggy

from attnhost.discovery import PluginInfo, PluginStatus, way_out
from attnhost.errors import (
    PluginLoadInterrupted,
    UnknownBackendError,
    bounded,
    describe_exception,
    one_line,
    plugin_label,
    printable_record,
    safe_repr,
)
from attnhost.hooks import call_plugin_hook
from attnhost.spec import BackendSpec, check_backend_name

__all__ = ["BackendEntry", "Contribution", "Registry", "Role", "build_registry", "collect_contributions"]

logger = logging.getLogger(__name__)
logger.addFilter(printable_record)  # plugin text in a log line is escaped

Role = Literal["target", "draft"]


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """A registered backend: its spec and which plugin gave it (and, if overridden, who declared it)."""

    spec: BackendSpec
    plugin: str
    distribution: str | None
    version: str | None
    draft: bool = False
    declared_by: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def label(self) -> str:
        return plugin_label(self.plugin, self.distribution, self.version)

    @property
    def roles(self) -> tuple[str, ...]:
        return ("target", "draft") if self.draft else ("target",)


@dataclass(frozen=True, slots=True)
class Contribution:
    """What one plugin's hooks returned, validated, before merging."""

    plugin: PluginInfo
    specs: tuple[BackendSpec, ...]
    draft_names: tuple[str, ...]


class Registry(Mapping[str, BackendSpec]):
    """Backend name (or alias) → canonical :class:`BackendSpec`; iteration yields canonical names, and ``drafts``
    keeps the order plugins declared them in (SGLang's for the built-ins)."""

    __slots__ = ("_aliases", "_draft", "_entries", "_failed", "_order")

    def __init__(
        self,
        entries: Mapping[str, BackendEntry],
        aliases: Mapping[str, str],
        drafts: Sequence[str],
        failed: Sequence[PluginInfo] = (),
    ) -> None:
        self._failed = tuple(failed)  # plugins that failed to load: an unknown name may be one they would give
        self._entries = MappingProxyType(dict(entries))
        self._aliases = MappingProxyType(dict(aliases))
        self._order = tuple(entries)
        self._draft = tuple(drafts)

    def canonical(self, name: str) -> str | None:
        """``name`` itself, or what it is an alias of; None for an unknown name."""
        return name if name in self._entries else self._aliases.get(name)

    def __getitem__(self, name: str) -> BackendSpec:
        return self.entry(name).spec

    def entry(self, name: str) -> BackendEntry:
        canonical = self.canonical(name) if isinstance(name, str) else None
        if canonical is None:
            raise UnknownBackendError(self.unknown_message(name))
        return self._entries[canonical]

    def failed_plugins_for(self, name: object) -> tuple[PluginInfo, ...]:
        """The plugins that failed to load and are named like ``name`` (their name or distribution contains it, or
        it contains theirs, ignoring case and ``-``/``_``): the likely reason it is unknown. The one rule for every
        message about a missing name (this registry's, the conformance kit's), so none blames a near name instead.
        """
        key, likely = str(name).lower().replace("-", "_"), list[PluginInfo]()
        for plugin in self._failed:
            names = {plugin.name.lower().replace("-", "_"), (plugin.distribution or "").lower().replace("-", "_")}
            if key and any(other and (key in other or other in key) for other in names):
                likely.append(plugin)
        return tuple(likely)

    def unknown_message(self, name: object) -> str:
        """``unknown attention backend 'x'; did you mean 'y'?`` — the one wording used everywhere — or, when a
        plugin that failed to load is named like it, that plugin's error and no near name (which would mislead)."""
        import difflib  # only for an unknown name

        shown = bounded(repr(name))
        if likely := self.failed_plugins_for(name):
            if len(likely) == 1:
                culprit = f"{likely[0].origin}, which would likely provide it, failed to load: {likely[0].error}"
            else:
                causes = "; ".join(f"{plugin.origin} ({plugin.error})" for plugin in likely)
                culprit = f"{len(likely)} plugins that would likely provide it failed to load: {causes}"
            them = "that plugin" if len(likely) == 1 else "them"
            return f"unknown attention backend {shown}: {culprit}; fix {them}, then check `attnhost plugins`"
        # A plugin that failed may have been the one to give it: said before any near name, which may mislead
        failed = ""
        if self._failed:
            named = ", ".join(plugin.origin for plugin in self._failed[:3])
            more = f" and {len(self._failed) - 3} more" if len(self._failed) > 3 else ""
            failed = f"; {named}{more} failed to load and may provide it (see `attnhost plugins`)"
        close = difflib.get_close_matches(str(name), [*self._order, *self._aliases], n=1, cutoff=0.6)
        if close:
            return f"unknown attention backend {shown}{failed}; did you mean {self.canonical(close[0])!r}?"
        choices = f"choose from: {', '.join(self._order)} (see `attnhost list`)"
        return f"unknown attention backend {shown}{failed}; {'or ' if failed else ''}{choices}"

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.canonical(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def names(self, role: Role | None = None) -> tuple[str, ...]:
        """Canonical names in registration order; ``role="draft"`` keeps only draft-capable ones."""
        if role == "draft":
            return self._draft
        if role in (None, "target"):
            return self._order
        raise ValueError(f"unknown role {role!r}; use 'target' or 'draft'")

    def aliases(self) -> Mapping[str, str]:
        return self._aliases

    def is_draft_capable(self, name: str) -> bool:
        """The one source of truth for draft capability (no other list may exist)."""
        return name in self and self.entry(name).draft

    def entries(self) -> tuple[BackendEntry, ...]:
        return tuple(self._entries.values())


class _BadReturn(TypeError):
    """A hook answered with the wrong type; the message starts with the hook's name."""


def _expect_sequence(value: object, hook_name: str, item_type: type, item_label: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):  # a str is no list; nor is None, which a plugin returns by mistake
        raise _BadReturn(
            f"{hook_name}() returned {type(value).__name__} {safe_repr(value)}; it must return a list of {item_label}s"
        )
    for item in value:
        if not isinstance(item, item_type):
            raise _BadReturn(
                f"{hook_name}() returned a list containing {type(item).__name__} {safe_repr(item)}; "
                f"every item must be a {item_label}"
            )
    return tuple(value)


def collect_contributions(pm: pluggy.PluginManager, plugins: Sequence[PluginInfo]) -> list[Contribution | PluginInfo]:
    """Ask each loaded plugin's hooks in turn, one item out per item in: a plugin whose hook raises or answers
    badly (that plugin alone) becomes a failed ``PluginInfo``, left registered for the caller, which owns the
    manager, to unregister."""
    out: list[Contribution | PluginInfo] = []
    for info in plugins:
        if info.status is not PluginStatus.LOADED:
            out.append(info)
            continue
        hook = "attnhost_attention_backends"
        try:
            specs = _expect_sequence(call_plugin_hook(pm, hook, info.name, ()), hook, BackendSpec, "BackendSpec")
            hook = "attnhost_draft_attention_backends"
            drafts = _expect_sequence(call_plugin_hook(pm, hook, info.name, ()), hook, str, "backend name")
            for draft_name in drafts:
                check_backend_name(draft_name, "draft backend name")
        except KeyboardInterrupt:
            raise PluginLoadInterrupted(f"interrupted while {info.origin} answered hook {hook}") from None
        except (Exception, SystemExit) as exc:
            cause = str(exc) if isinstance(exc, _BadReturn) else f"hook {hook} raised {describe_exception(exc)}"
            failed = replace(info, status=PluginStatus.FAILED, error=one_line(cause))
            logger.warning(
                "%s failed to load: %s; its backends are ignored; %s", failed.origin, failed.error, way_out(failed)
            )
            out.append(failed)
            continue
        out.append(Contribution(info, specs, drafts))
    return out


def build_registry(contributions: Sequence[Contribution | PluginInfo]) -> tuple[Registry, list[PluginInfo]]:
    """Merge contributions in order into a registry; returns it and the final plugin records. The first registration of
    a name wins, except that an implementation fills a declared-only name. Each collision is noted on the plugin that
    lost, for the host to log once (the registry is rebuilt on every registration)."""
    entries: dict[str, BackendEntry] = {}
    aliases: dict[str, str] = {}  # disjoint from entries: a name becomes either only while it is neither
    notes: defaultdict[str, list[str]] = defaultdict(list)  # plugin name → the collisions it lost
    owned: defaultdict[str, list[str]] = defaultdict(list)  # plugin name → the backends it gave
    draft_order: list[str] = []
    contribs = [c for c in contributions if isinstance(c, Contribution)]
    for contrib in contribs:
        plugin, note = contrib.plugin, notes[contrib.plugin.name].append
        for spec in contrib.specs:
            existing = entries.get(aliases.get(spec.name, spec.name))
            if existing is not None and existing.name != spec.name:
                note(
                    f"{plugin.origin} registers backend {spec.name!r}, which is already an alias of "
                    f"{existing.name!r} from {existing.label}; ignored — rename the backend"
                )
                continue
            if existing is not None and (existing.spec.implemented or not spec.implemented):
                if spec.implemented and existing.plugin == plugin.name:
                    note(f"{plugin.origin} registers backend {spec.name!r} twice; the first is kept")
                elif spec.implemented:
                    note(
                        f"backend {spec.name!r} is implemented by both {existing.label} and {plugin.origin}; keeping "
                        f"{existing.plugin!r}'s (registered first) — to choose, list the plugins in ATTNHOST_PLUGINS "
                        "in the order you prefer (the first listed keeps a shared name), or uninstall one"
                    )
                continue  # declaring a name that already exists adds nothing
            merged, declarer = spec, None
            if existing is not None:  # implementing a declared-only name keeps what the declaration said
                declarer = existing.plugin
                merged = replace(
                    spec,
                    aliases=tuple(dict.fromkeys(existing.spec.aliases + spec.aliases)),
                    platforms=spec.platforms or existing.spec.platforms,
                    requires=spec.requires or existing.spec.requires,
                    provided_by=spec.provided_by or existing.spec.provided_by,
                    description=spec.description or existing.spec.description,
                )
            entries[spec.name] = BackendEntry(merged, plugin.name, plugin.distribution, plugin.version, False, declarer)
            owned[plugin.name].append(spec.name)
            for alias in spec.aliases:
                owner = entries.get(aliases.get(alias, alias))
                if owner is None:
                    aliases[alias] = spec.name
                elif owner.name != spec.name:
                    note(
                        f"{plugin.origin} gives backend {spec.name!r} the alias {alias!r}, which already names "
                        f"{owner.name!r} from {owner.label}; alias ignored"
                    )
    for contrib in contribs:
        for name in contrib.draft_names:
            owner = entries.get(aliases.get(name, name))
            if owner is None:
                notes[contrib.plugin.name].append(
                    f"{contrib.plugin.origin} declares draft backend {name!r}, but no plugin registered a backend "
                    "of that name; ignored — register it from attnhost_attention_backends too"
                )
            elif not owner.draft:
                entries[owner.name] = replace(owner, draft=True)
                draft_order.append(owner.name)
    # A record that is not a contribution contributed nothing, even when a loaded plugin has the same name
    plugins = [
        replace(
            item.plugin,
            backends=tuple(owned.get(item.plugin.name, ())),
            warnings=item.plugin.warnings + tuple(map(one_line, notes.get(item.plugin.name, ()))),
        )
        if isinstance(item, Contribution)
        else replace(item, backends=())
        for item in contributions
    ]
    failed = [p for p in plugins if p.status is PluginStatus.FAILED]
    return Registry(entries, aliases, draft_order, failed), plugins
