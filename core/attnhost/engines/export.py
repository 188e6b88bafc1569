"""Which attnhost backends an engine gets, and under which names: one rule for every engine.

Both bridges must agree on it, or a plugin would answer to one name in
SGLang and another in vLLM: only implemented backends that can run on this
platform are exported (a declared-only name adds nothing); a name the
engine already implements keeps the engine's implementation, and the
attnhost one is reachable as ``attnhost_<name>`` — unless the operator opts
in to an override by naming it in the engine's override variable.

Every engine name maps to exactly one attnhost backend. When two backends
end up with one engine name (a plugin backend literally named
``attnhost_torch_native``; vLLM's ``my-attn`` and ``MY.ATTN``, both
``MY_ATTN``), the fixed order decides: the registry's, the built-in plugin
first and then the plugins in discovery order; the first keeps the name and
one warning names both backends and their plugins (``ATTNHOST_STRICT=1``:
an error). An implemented backend that is not exported (it cannot run here:
a plugin's ``fa3`` inherits the declaration's ``requires`` of
``sgl_kernel``) is said once, at INFO, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

from attnhost.availability import check_availability
from attnhost.errors import PluginLoadError
from attnhost.host import get_registry
from attnhost.platform import current_platform
from attnhost.registry import BackendEntry
from attnhost.settings import STRICT_ENV, current

__all__ = ["CLASH_PREFIX", "ExportPlan", "ExportedBackend", "plan_exports"]

logger = logging.getLogger("attnhost.engines")
_said: set[str] = set()  # skipped backends already logged in this process (plans are made again on every sync)

CLASH_PREFIX = "attnhost_"
"""The prefix an attnhost backend gets in an engine that already implements its name."""


@dataclass(frozen=True, slots=True)
class ExportedBackend:
    """One attnhost backend as an engine will know it."""

    entry: BackendEntry
    engine_name: str
    """The name the engine's flags take (``attnhost_torch_native`` when the engine has ``torch_native``)."""
    aliases: tuple[str, ...]
    """Further engine names for it (its attnhost aliases that do not clash)."""
    overrides: bool
    """True when the operator asked for it to replace the engine's own implementation of the name."""

    @property
    def name(self) -> str:
        """The attnhost name."""
        return self.entry.name

    @property
    def draft(self) -> bool:
        return self.entry.draft

    @property
    def engine_names(self) -> tuple[str, ...]:
        return (self.engine_name, *self.aliases)


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """Every exported backend, plus one line per decision an operator should see."""

    backends: tuple[ExportedBackend, ...]
    warnings: tuple[str, ...]
    skipped: tuple[str, ...]
    """Implemented backends not exported, each with its reason (unavailable here)."""

    def engine_name(self, attnhost_name: str) -> str | None:
        """The engine name of an exported attnhost backend (canonical name or alias), else ``None``."""
        canonical = get_registry().canonical(attnhost_name)
        for backend in self.backends:
            if backend.name == canonical:
                return backend.engine_name
        return None

    def by_engine_name(self, engine_name: str) -> ExportedBackend | None:
        for backend in self.backends:
            if engine_name in backend.engine_names:
                return backend
        return None


def override_names(env_var: str) -> frozenset[str]:
    """The attnhost names the operator lets replace the engine's own implementation (read once per process)."""
    return current().name_lists[env_var]


def plan_exports(
    engine: str,
    engine_has: Callable[[str], bool],
    *,
    override_env: str,
    to_engine_name: Callable[[str], str] = lambda name: name,
    taken: Collection[str] = (),
) -> ExportPlan:
    """Decide the exports for ``engine`` (``"SGLang"``, ``"vLLM"``) from the current registry.

    ``engine_has(name)`` says whether the engine implements ``name`` itself;
    ``to_engine_name`` spells an attnhost name the engine's way (vLLM's enum
    wants upper-case identifiers); ``taken`` are names already exported in
    this process (a second call must not warn about its own earlier work).
    """
    registry = get_registry()
    platform = current_platform()
    named = override_names(override_env)
    unknown = sorted(name for name in named if registry.canonical(name) is None)
    overrides = {registry.canonical(name) or name for name in named}  # an alias names its backend
    warnings: list[str] = []
    if unknown:
        warnings.append(
            f"{override_env} names {', '.join(map(repr, unknown))}, which no installed attnhost plugin "
            "registers; ignored (see `attnhost list`)"
        )
    exported: list[ExportedBackend] = []
    skipped: list[str] = []
    owners: dict[str, BackendEntry] = {}  # engine name -> the attnhost backend that has it
    clashes: list[str] = []
    for entry in registry.entries():
        availability = check_availability(entry, platform)
        if not availability.available:
            if entry.name in overrides:  # an override that does nothing says why
                warnings.append(
                    f"{override_env} names {entry.name!r}, which {engine} does not get: {availability.reason}"
                )
            if entry.spec.implemented:  # a declared-only name adds nothing to an engine
                skipped.append(f"{entry.name}: {availability.reason}")
                if (
                    line := f"attnhost backend {entry.name!r} ({entry.label}) is not registered in {engine}: "
                    f"{availability.reason}"
                ) not in _said:
                    _said.add(line)
                    logger.info("%s", line)
            continue
        name = to_engine_name(entry.name)
        override = entry.name in overrides
        if engine_has(name) and name not in taken and not override:
            renamed = to_engine_name(CLASH_PREFIX + entry.name)
            warnings.append(
                f"attnhost backend {entry.name!r} (plugin {entry.plugin!r}) is available in {engine} as "
                f"{renamed!r}: {engine} implements {name!r} itself and keeps it; set {override_env}={entry.name} "
                f"to replace {engine}'s"
            )
            name = renamed
        elif override and engine_has(name) and name not in taken:
            warnings.append(
                f"attnhost backend {entry.name!r} (plugin {entry.plugin!r}) replaces {engine}'s own {name!r}, "
                f"as {override_env} asks"
            )
        if (first := owners.get(name)) is not None:
            clashes.append(
                f"attnhost backends {first.name!r} ({first.label}) and {entry.name!r} ({entry.label}) both become "
                f"{engine} backend {name!r}; {first.name!r} keeps it (registered first) and {entry.name!r} is not "
                f"registered in {engine} — rename one, or leave one out with ATTNHOST_PLUGINS"
            )
            continue
        aliases = []
        for alias in entry.spec.aliases:
            spelled = to_engine_name(alias)
            if spelled in owners or spelled == name or (engine_has(spelled) and spelled not in taken):
                warnings.append(
                    f"alias {alias!r} of attnhost backend {entry.name!r} is not registered in {engine}: "
                    f"{engine} already has {spelled!r}; use {name!r}"
                )
                continue
            aliases.append(spelled)
        owners.update(dict.fromkeys((name, *aliases), entry))
        exported.append(ExportedBackend(entry, name, tuple(aliases), override))
    if clashes and current().load.strict:
        raise PluginLoadError(f"{STRICT_ENV}=1 and {'; '.join(clashes)}; or unset {STRICT_ENV}")
    return ExportPlan(tuple(exported), (*warnings, *clashes), tuple(skipped))
