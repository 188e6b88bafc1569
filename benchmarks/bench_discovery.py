"""Discovery at scale: attnhost's entry-point scan (uncached, cached) against importlib-metadata, pluggy, stevedore.

Two questions, two tables, all on the same synthetic site-packages (N
distributions, N/10 of them attnhost plugins, ahead of this interpreter's own
``sys.path``):

* **find**: which entry points of the group exist. attnhost ``scan()``
  uncached (``importlib_metadata`` answers, plus the survey that keys and
  binds the cache) and cached (the cache file read, its key re-validated and
  every record checked against its ``entry_points.txt``, as a new process
  does; the in-process memo is cleared each time), against
  ``importlib_metadata.entry_points(group=)`` — the library that answers a
  miss, with its in-process listing cache cleared (as in a new process) and
  warm (repeated calls in one process) — the standard library's
  ``importlib.metadata.entry_points(group=)``, and stevedore's file cache
  (``stevedore._cache.get_group_all``, its in-process copy cleared each time).
* **find + import + register**: what a host does at start-up. attnhost's
  discovery (``scan`` + ``load_entry_points`` into a fresh pluggy manager),
  against pluggy's own ``PluginManager.load_setuptools_entrypoints`` and
  stevedore's ``ExtensionManager`` (file cache hit, in-process cache cleared).
  Plugin modules are in ``sys.modules`` after the first round for everyone,
  so this compares the discovery machinery, not Python's import system.

All in-process, warm page cache; medians of interleaved rounds. stevedore is a
benchmark-only dependency (``benchmarks/requirements.txt``); without it its rows
are skipped with a note.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from _common import GROUP, Row, Stats, interleaved, per_call, stable_base_path

if TYPE_CHECKING:
    from attnhost.settings import LoadSettings


def _stevedore(xdg: Path) -> tuple[Callable[[], object], Callable[[], object]] | None:
    """stevedore's cached find and cached ExtensionManager, with its cache in ``xdg``; None if not installed."""
    os.environ["XDG_CACHE_HOME"] = str(xdg)
    try:
        from stevedore import _cache
        from stevedore.extension import ExtensionManager
    except ImportError:
        return None
    cache = _cache.Cache(os.path.join(str(xdg), "python-entrypoints"))  # a private directory
    _cache._c = cache
    _cache.get_group_all = cache.get_group_all

    def find() -> object:
        cache._internal.clear()
        return cache.get_group_all(GROUP)

    def manager() -> object:
        cache._internal.clear()
        ExtensionManager.ENTRY_POINT_CACHE.clear()
        return ExtensionManager(GROUP, invoke_on_load=False)

    return find, manager


def run(rounds: int, workdir: Path, environments: dict[int, Path]) -> list[Row]:
    from attnhost.settings import LoadSettings

    xdg = workdir / "xdg-discovery"
    os.environ["XDG_CACHE_HOME"] = str(xdg)
    os.environ.pop("ATTNHOST_NO_CACHE", None)
    stevedore = _stevedore(xdg)
    settings = LoadSettings(allow=None, autoload=True, strict=False)
    saved_path = list(sys.path)
    rows: list[Row] = []
    try:
        for n_dists, root in sorted(environments.items()):
            rows += _measure(rounds, n_dists, root, stevedore, settings)
    finally:
        sys.path[:] = saved_path
        importlib.invalidate_caches()
    return rows


def _measure(
    rounds: int,
    n_dists: int,
    root: Path,
    stevedore: tuple[Callable[[], object], Callable[[], object]] | None,
    settings: LoadSettings,
) -> list[Row]:
    import importlib.metadata as metadata

    import importlib_metadata
    import pluggy

    # The built-in is registered directly (it is attnhost's own code); import it while attnhost's own
    # install is still on the path, which stable_base_path() leaves out when that is inside the repo (.tox).
    import attnhost_builtin  # noqa: F401
    from attnhost import entry_points
    from attnhost.discovery import GuardedPluginManager, load_entry_points
    from attnhost.hooks import PROJECT_NAME, AttnhostHookSpecs

    path = [str(root), *stable_base_path()]
    sys.path[:] = path
    importlib.invalidate_caches()
    n_plugins = sum(1 for r in entry_points.scan(GROUP, use_cache=False) if r.location == str(root))
    case = f"{n_dists} dists / {n_plugins} plugins"

    def uncached() -> object:
        return entry_points.scan(GROUP, use_cache=False)

    def cached() -> object:
        entry_points.clear_memo()
        return entry_points.scan(GROUP, use_cache=True)

    def memo() -> object:
        return entry_points.scan(GROUP, use_cache=True)

    def host(use_cache: bool) -> Callable[[], object]:
        def discover() -> object:
            entry_points.clear_memo()
            pm = GuardedPluginManager(lambda what: contextlib.nullcontext())
            records = entry_points.scan(GROUP, use_cache=use_cache)
            return load_entry_points(pm, records, settings)

        return discover

    def pluggy_load() -> object:
        pm = pluggy.PluginManager(PROJECT_NAME)
        pm.add_hookspecs(AttnhostHookSpecs)
        return pm.load_setuptools_entrypoints(GROUP)

    def importlib_find() -> object:
        return metadata.entry_points(group=GROUP)

    def backport_cold() -> object:
        importlib_metadata.MetadataPathFinder.invalidate_caches()  # what a new process starts with
        return importlib_metadata.entry_points(group=GROUP)

    def backport_warm() -> object:
        return importlib_metadata.entry_points(group=GROUP)

    # Prime: plugin modules imported, both caches written, and the attnhost cache verified.
    host(True)()
    pluggy_load()
    entry_points.clear_memo()
    entry_points.reset_scan_stats()
    cached()
    engaged = entry_points.scan_stats()["cache_hits"] == 1
    notes = [] if engaged else ["attnhost's cache did not engage (environment changed < 3 s ago)"]
    number = 3 if n_dists >= 1000 else 10
    find_subjects: dict[str, Callable[[], float | None]] = {
        "uncached": per_call(uncached, number),
        "cached": per_call(cached, number),
        "memo": per_call(memo, number),
        "importlib": per_call(importlib_find, number),
        "backport_cold": per_call(backport_cold, number),
        "backport_warm": per_call(backport_warm, number),
    }
    load_subjects: dict[str, Callable[[], float | None]] = {
        "host_uncached": per_call(host(False), number),
        "host_cached": per_call(host(True), number),
        "pluggy": per_call(pluggy_load, number),
    }
    if stevedore is not None:
        stevedore[0]()
        stevedore[1]()
        find_subjects["stevedore"] = per_call(stevedore[0], number)
        load_subjects["stevedore"] = per_call(stevedore[1], number)
    find = interleaved(find_subjects, rounds)
    load = interleaved(load_subjects, rounds)
    return _rows(case, find, load, notes, stevedore is not None)


def _row(
    section: str,
    case: str,
    stats: dict[str, Stats],
    key: str,
    label: str,
    base: str,
    base_label: str,
    max_ratio: float | None = None,
    target: str | None = None,
    notes: list[str] | None = None,
) -> Row:
    return Row(
        section=section,
        case=case,
        candidate=label,
        value=stats[key].median * 1e3,
        baseline=base_label,
        baseline_value=stats[base].median * 1e3,
        unit="ms",
        spread=stats[key].spread,
        baseline_spread=stats[base].spread,
        n=stats[key].n,
        target=target,
        max_ratio=max_ratio,
        notes=notes or [],
    )


def _rows(
    case: str, find: dict[str, Stats], load: dict[str, Stats], notes: list[str], have_stevedore: bool
) -> list[Row]:
    big = case.startswith("1000 ")
    find_section, load_section = "discovery: find", "discovery: find+import+register"
    rows = [
        _row(
            find_section,
            case,
            find,
            "cached",
            "attnhost scan, cached",
            "backport_cold",
            "importlib_metadata.entry_points(group=), new process",
            0.2 if big else None,
            "ratio <= 0.2 (5x faster)" if big else None,
            notes,
        ),
        _row(
            find_section,
            case,
            find,
            "cached",
            "attnhost scan, cached",
            "backport_warm",
            "importlib_metadata.entry_points(group=), warm in-process",
            0.2 if big else None,
            "ratio <= 0.2 (5x faster)" if big else None,
            notes,
        ),
        _row(
            find_section,
            case,
            find,
            "cached",
            "attnhost scan, cached",
            "uncached",
            "attnhost scan, uncached",
            1 / 3 if big else None,
            "ratio <= 0.33 (3x faster)" if big else None,
        ),
        _row(find_section, case, find, "memo", "attnhost scan, in-process memo", "uncached", "attnhost scan, uncached"),
        _row(
            find_section,
            case,
            find,
            "uncached",
            "attnhost scan, uncached",
            "backport_cold",
            "importlib_metadata.entry_points(group=), new process",
        ),
        _row(
            find_section,
            case,
            find,
            "cached",
            "attnhost scan, cached",
            "importlib",
            "importlib.metadata.entry_points(group=) (standard library)",
        ),
    ]
    if have_stevedore:
        rows.append(
            _row(
                find_section,
                case,
                find,
                "cached",
                "attnhost scan, cached",
                "stevedore",
                "stevedore cache get_group_all, cached",
            )
        )
    rows += [
        _row(
            load_section,
            case,
            load,
            "host_cached",
            "attnhost discovery, cached",
            "host_uncached",
            "attnhost discovery, uncached",
        ),
        _row(
            load_section,
            case,
            load,
            "host_cached",
            "attnhost discovery, cached",
            "pluggy",
            "pluggy load_setuptools_entrypoints",
        ),
    ]
    if have_stevedore:
        rows.append(
            _row(
                load_section,
                case,
                load,
                "host_cached",
                "attnhost discovery, cached",
                "stevedore",
                "stevedore ExtensionManager, cached",
                1.0 if big else None,
                "ratio <= 1.0" if big else None,
            )
        )
    else:
        rows.append(
            Row(
                load_section,
                case,
                "attnhost discovery, cached",
                load["host_cached"].median * 1e3,
                "stevedore ExtensionManager (not installed: pip install -r benchmarks/requirements.txt)",
                float("nan"),
                "ms",
                notes=["stevedore is not installed; comparison skipped"],
            )
        )
    return rows
