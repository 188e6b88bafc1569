"""Entry points of one group: answered by ``importlib_metadata``, remembered by a cache that checks itself.

While :mod:`attnhost.entry_points_cache` describes the disk, :func:`scan` answers from it without importing
``importlib_metadata`` (most of every ``attnhost`` start-up), a record only while its ``entry_points.txt``
declares it.
"""

from __future__ import annotations

import os
import sys
import time

from attnhost import entry_points_cache as cache

__all__ = ["RACY_WINDOW_NS", "EntryPointRecord", "clear_memo", "normalize_name", "reset_scan_stats", "scan"]
__all__ += ["scan_stats"]

#: A scan is not cached while anything in its key is younger than this (read at call time; tests lower it).
RACY_WINDOW_NS = 3_000_000_000

#: What :func:`scan` did in this process: tests prove hits with it, benchmarks that the cache engaged.
_STATS = dict.fromkeys(
    ("scans", "memo_hits", "cache_hits", "cache_misses", "uncached", "cache_writes", "racy_skips", "rejected"), 0
)
_Answer = tuple[str, cache.Plan, tuple["EntryPointRecord", ...]]
_MEMO: dict[str, _Answer] = {}
_FIELDS = ("name", "value", "group", "distribution", "version", "location", "source")
_STANDARD_FINDERS = {("_frozen_importlib_external", "PathFinder"), ("importlib_metadata", "MetadataPathFinder")}


class EntryPointRecord(tuple[str, str, str, str, str, str, str]):
    """An entry point with its distribution's ``Name``/``Version``, ``sys.path`` entry and metadata directory
    (``""`` if none): an immutable tuple with named fields, as ``namedtuple`` makes (importing ``collections``,
    ``typing`` or ``dataclasses`` would cost more than a hit)."""

    __slots__ = ()
    name: str
    value: str
    group: str
    distribution: str
    version: str
    location: str
    source: str

    def __new__(
        cls, name: str, value: str, group: str, distribution: str, version: str, location: str, source: str = ""
    ) -> EntryPointRecord:
        return super().__new__(cls, (name, value, group, distribution, version, location, source))

    def __getnewargs__(self) -> tuple[str, ...]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"EntryPointRecord{tuple(self)!r}"

    @property
    def parts(self) -> tuple[str, str, tuple[str, ...]]:
        """``(module, attr, extras)``, as ``importlib_metadata`` parses the value; all empty if it is malformed."""
        import re  # loading a plugin imports far more than this; a scan does not need it

        match = re.match(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$", self.value)
        if match is None:
            return "", "", ()
        return match["module"], match["attr"] or "", tuple(re.findall(r"\w+", match["extras"] or ""))

    def load(self) -> object:
        """Import the module and walk the attribute path, as ``EntryPoint.load()`` does; ``ValueError`` if malformed."""
        module, attr, _ = self.parts
        if not module:
            raise ValueError(f"malformed entry point value {self.value!r} for {self.name!r}")
        __import__(module)
        obj: object = sys.modules[module]
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        return obj


def _field(index: int) -> property:
    return property(lambda record: record[index])


for _index, _name in enumerate(_FIELDS):  # the fields as properties, as namedtuple makes them
    setattr(EntryPointRecord, _name, _field(_index))


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: lower case, runs of ``-_.`` become one ``-`` (no ``re`` import)."""
    s = name.lower().replace("_", "-").replace(".", "-")
    while "--" in s:
        s = s.replace("--", "-")
    return s


def scan_stats() -> dict[str, int]:
    return dict(_STATS)


def reset_scan_stats() -> None:
    _STATS.update(dict.fromkeys(_STATS, 0))


def clear_memo() -> None:
    """Forget in-process answers, so the next :func:`scan` consults the cache file."""
    _MEMO.clear()


def _paths() -> list[str]:
    return [entry for entry in sys.path if isinstance(entry, str)]


def scan(group: str, *, use_cache: bool = True) -> tuple[EntryPointRecord, ...]:
    """``importlib_metadata.entry_points(group=group)`` on ``sys.path``, from the cache while its key holds.

    The host passes ``use_cache`` from its settings (``ATTNHOST_NO_CACHE``); reading them here would import more.
    A custom distribution finder on ``sys.meta_path`` (its finds are beyond the key) also means no cache.
    """
    _STATS["scans"] += 1
    path = _paths()
    ident = cache.identity(group, path)
    finders = (f if isinstance(f, type) else type(f) for f in sys.meta_path if hasattr(f, "find_distributions"))
    if not use_cache or any((cls.__module__, cls.__name__) not in _STANDARD_FINDERS for cls in finders):
        _STATS["uncached"] += 1
        return _from_importlib(group, path)[0]
    memo = _MEMO.get(ident)
    if memo is not None and cache.key(ident, path, memo[1])[0] == memo[0]:
        _STATS["memo_hits"] += 1
        return memo[2]
    file = cache.cache_file(ident)
    stored, writable = (None, False) if file is None else cache.read_cache(file, len(path))
    hit = None if stored is None else _verified(stored, ident, group, path)
    if hit is not None:
        _STATS["cache_hits"] += 1
        _MEMO[ident] = hit
        return hit[2]
    _STATS["cache_misses"] += 1
    digest, newest, plan = cache.survey(ident, path, group)
    records, rows = _from_importlib(group, path)
    if rows is None:
        return records
    if newest > time.time_ns() - RACY_WINDOW_NS:
        _STATS["racy_skips"] += 1
        return records
    _MEMO[ident] = (digest, plan, records)
    text = cache.encode(digest, plan, rows)
    if file is not None and writable and text is not None and cache.write_cache(file, text):
        _STATS["cache_writes"] += 1
    return records


def _verified(stored: cache.Stored, ident: str, group: str, path: list[str]) -> _Answer | None:
    """The stored answer, if its key still holds and each record's ``entry_points.txt`` declares it now."""
    digest, plan, rows = stored
    if cache.key(ident, path, plan)[0] != digest:
        return None  # the disk changed: an ordinary miss
    texts = {where: cache.read_entry_points_text(path[where[0]], where[1]) for where in {row[4:] for row in rows}}
    for name, value, _, _, idx, child in rows:
        if not cache.declares(texts[idx, child], group, name, value):
            _STATS["rejected"] += 1
            cache.ignored(f"it holds entry point {name!r} = {value!r}, which {path[idx]}/{child} does not declare")
            return None
    records = (EntryPointRecord(n, v, group, d, ver, path[i], os.path.join(path[i], c)) for n, v, d, ver, i, c in rows)
    return digest, plan, tuple(records)


def _from_importlib(group: str, path: list[str]) -> tuple[tuple[EntryPointRecord, ...], list[cache.Row] | None]:
    """Ask ``importlib_metadata``; rows tie records to their metadata directories (``None``: do not cache)."""
    import contextlib  # the miss path: importlib_metadata imports it anyway

    import importlib_metadata as md

    md.MetadataPathFinder.invalidate_caches()  # its own listing cache keys on whole-second mtimes
    try:
        found = list(md.entry_points(group=group))
    except Exception:  # e.g. one entry_points.txt that is not UTF-8 breaks the whole call: one at a time, then
        import logging

        from attnhost.errors import describe_exception, printable

        found, seen = [], set()
        for dist in md.distributions():
            label = "?"
            try:
                label = printable(f"{dist.name} {dist.version}")
                if (key := normalize_name(str(dist.name))) not in seen:  # the first of a name, as importlib_metadata
                    seen.add(key)
                    found += [ep for ep in dist.entry_points if ep.group == group]
            except Exception as exc:
                where, why = dist.locate_file(""), describe_exception(exc)
                message = "distribution %s at %s has unreadable metadata (%s), so its entry points are skipped"
                logging.getLogger("attnhost").warning(message + "; reinstall or remove it", label, where, why)
    index = {os.path.normpath(entry or "."): i for i, entry in reversed(list(enumerate(path)))}  # the first wins
    records: list[EntryPointRecord] = []
    rows: list[cache.Row] = []
    for ep in found:
        dist = ep.dist
        assert dist is not None  # importlib_metadata reads every entry point from a distribution
        name = version = source = ""
        with contextlib.suppress(Exception):  # metadata without Name/Version
            name, version = str(dist.name or ""), str(dist.version or "")
        location = os.path.normpath(str(dist.locate_file("")))
        # A path distribution's metadata directory, as pip reads it too (importlib_metadata names it nowhere else).
        child = str(getattr(getattr(dist, "_path", None), "name", ""))
        if (idx := index.get(location)) is not None:
            location = path[idx]
            if child and os.path.isdir(os.path.join(location, child)):
                source = os.path.join(location, child)
                rows.append((ep.name, ep.value, name, version, idx, child))
        records.append(EntryPointRecord(ep.name, ep.value, group, name, version, location, source))
    cacheable = len(rows) == len(records) and _paths() == path  # sys.path changed: the answer is for either
    return tuple(records), rows if cacheable else None
