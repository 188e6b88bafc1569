"""Entry points of one group: answered by ``importlib_metadata``, remembered by a cache that checks itself.

:func:`scan` returns what ``importlib_metadata.entry_points(group=group)``
returns for the current ``sys.path``, in the same order, as
:class:`EntryPointRecord` objects. When the on-disk cache
(:mod:`attnhost.entry_points_cache`) still describes the disk, the answer
comes from it and neither ``importlib.metadata`` nor ``importlib_metadata``
is imported: every serving process and every ``attnhost`` command discovers
plugins, and importing and running the library is most of their start-up
(figures in BENCHMARKS.md). Otherwise ``importlib_metadata`` (a declared
dependency, so the rules are the same on every supported Python) answers,
and the answer is cached.

The in-process memo holds the last answer per group and path; a repeated
:func:`scan` still recomputes the key, so it sees an install made since.

``ATTNHOST_NO_CACHE=1`` (``1/true/yes/on``) disables the memo and the file;
``use_cache=`` overrides the environment variable. A custom distribution
finder on ``sys.meta_path`` (one other than the standard path finders)
disables them too, since the key cannot see what it finds.
"""

from __future__ import annotations

import os
import sys
import time

from attnhost import entry_points_cache as cache

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "NO_CACHE_ENV",
    "RACY_WINDOW_NS",
    "EntryPointRecord",
    "cache_file",
    "clear_memo",
    "normalize_name",
    "reset_scan_stats",
    "scan",
    "scan_stats",
]

NO_CACHE_ENV = "ATTNHOST_NO_CACHE"
"""``attnhost.settings`` lists it with the others; read here directly, since a cache hit imports nothing more."""
#: A scan is not cached while anything in its key is younger than this (read at call time; tests lower it).
RACY_WINDOW_NS = 3_000_000_000

_TRUE = frozenset({"1", "true", "yes", "on"})

#: What :func:`scan` did in this process; tests use it to prove hits, benchmarks to prove the cache engaged.
_STATS: dict[str, int] = dict.fromkeys(
    ("scans", "memo_hits", "cache_hits", "cache_misses", "uncached", "cache_writes", "racy_skips", "rejected"), 0
)
_MEMO: dict[str, tuple[str, cache.Plan, tuple[EntryPointRecord, ...]]] = {}


class EntryPointRecord:
    """One entry point as ``importlib_metadata`` reports it, plus where it was declared: immutable, hashable.

    ``value`` is ``EntryPoint.value``; ``distribution``/``version`` are the
    declaring distribution's ``Name``/``Version`` as written; ``location`` is
    the ``sys.path`` entry it was found on; ``source`` its metadata directory
    (``""`` when not a directory, e.g. inside a zip). A hand-written
    ``__slots__`` class: importing ``dataclasses`` costs more than a cached scan.
    """

    __slots__ = ("distribution", "group", "location", "name", "source", "value", "version")

    name: str
    value: str
    group: str
    distribution: str
    version: str
    location: str
    source: str

    def __init__(
        self, name: str, value: str, group: str, distribution: str, version: str, location: str, source: str = ""
    ) -> None:
        setter = object.__setattr__
        setter(self, "name", name)
        setter(self, "value", value)
        setter(self, "group", group)
        setter(self, "distribution", distribution)
        setter(self, "version", version)
        setter(self, "location", location)
        setter(self, "source", source)

    def _astuple(self) -> tuple[str, str, str, str, str, str, str]:
        return (self.name, self.value, self.group, self.distribution, self.version, self.location, self.source)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of frozen EntryPointRecord")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of frozen EntryPointRecord")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, EntryPointRecord)
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash(self._astuple())

    def __repr__(self) -> str:
        return (
            f"EntryPointRecord(name={self.name!r}, value={self.value!r}, group={self.group!r}, "
            f"distribution={self.distribution!r}, version={self.version!r}, location={self.location!r}, "
            f"source={self.source!r})"
        )

    def __reduce__(self) -> tuple[type[EntryPointRecord], tuple[str, str, str, str, str, str, str]]:
        return (EntryPointRecord, self._astuple())

    def _parts(self) -> tuple[str, str, tuple[str, ...]] | None:
        """``module``, ``attr``, ``extras`` by the entry-point specification's grammar (``EntryPoint.pattern``)."""
        import re  # loading a plugin imports far more than this; scanning does not need it

        match = re.match(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$", self.value)
        if match is None:
            return None
        return match["module"], match["attr"] or "", tuple(re.findall(r"\w+", match["extras"] or ""))

    @property
    def module(self) -> str:
        """The module part of :attr:`value` (``"pkg.mod"`` of ``"pkg.mod:obj.attr"``); ``""`` if malformed."""
        parts = self._parts()
        return parts[0] if parts else ""

    @property
    def attr(self) -> str:
        """The attribute path of :attr:`value` (``"obj.attr"``), ``""`` for a module reference."""
        parts = self._parts()
        return parts[1] if parts else ""

    @property
    def extras(self) -> tuple[str, ...]:
        """The ``[extra]`` names of :attr:`value`."""
        parts = self._parts()
        return parts[2] if parts else ()

    def load(self) -> object:
        """Import the module and walk the attribute path, as ``EntryPoint.load()`` does (no ``importlib.metadata``).

        Raises ``ValueError`` for a value that is not ``module[:attr]``, and
        whatever the import or attribute lookup raises.
        """
        parts = self._parts()
        if parts is None:
            raise ValueError(f"malformed entry point value {self.value!r} for {self.name!r}")
        module, attr, _ = parts
        __import__(module)
        obj: object = sys.modules[module]
        for part in attr.split("."):
            if part:
                obj = getattr(obj, part)
        return obj

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready mapping (for ``attnhost plugins --json`` and friends)."""
        return {
            "name": self.name,
            "value": self.value,
            "group": self.group,
            "distribution": self.distribution,
            "version": self.version,
            "location": self.location,
            "source": self.source,
        }


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: lower case, runs of ``-_.`` become one ``-`` (no ``re`` import)."""
    s = name.lower().replace("_", "-").replace(".", "-")
    while "--" in s:
        s = s.replace("--", "-")
    return s


def scan_stats() -> dict[str, int]:
    """Counters of what :func:`scan` did in this process (a copy)."""
    return dict(_STATS)


def reset_scan_stats() -> None:
    """Zero the counters returned by :func:`scan_stats`."""
    for key in _STATS:
        _STATS[key] = 0


def clear_memo() -> None:
    """Forget in-process answers, so the next :func:`scan` consults the cache file."""
    _MEMO.clear()


def cache_file(group: str) -> str | None:
    """The cache file :func:`scan` uses for *group* on the current ``sys.path`` (``None``: no cache)."""
    return cache.cache_file(cache.identity(group, _paths()))


def _paths() -> list[str]:
    return [entry for entry in sys.path if isinstance(entry, str)]


def _env_cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in _TRUE


def _standard_finders_only() -> bool:
    """Whether every distribution finder on ``sys.meta_path`` is one of the standard path-based ones."""
    for finder in sys.meta_path:
        if getattr(finder, "find_distributions", None) is None:
            continue
        cls = finder if isinstance(finder, type) else type(finder)
        where = (cls.__module__, cls.__name__)
        if where not in (("_frozen_importlib_external", "PathFinder"), ("importlib_metadata", "MetadataPathFinder")):
            return False
    return True


def scan(group: str, *, use_cache: bool | None = None) -> tuple[EntryPointRecord, ...]:
    """``importlib_metadata.entry_points(group=group)`` on the current ``sys.path``, as records, maybe cached.

    The key is recomputed on every call, so a change made since the previous
    call is always seen. Never raises because of the environment or the cache.
    """
    _STATS["scans"] += 1
    path = _paths()
    enabled = _env_cache_enabled() if use_cache is None else use_cache
    ident = cache.identity(group, path)
    if not enabled or not _standard_finders_only():
        _STATS["uncached"] += 1
        return _from_importlib(group, path, cache.survey(ident, path, group))[0]
    memo = _MEMO.get(ident)
    if memo is not None and cache.key(ident, path, memo[1]) == memo[0]:
        _STATS["memo_hits"] += 1
        return memo[2]
    file = cache.cache_file(ident)
    if file is not None:
        text, writable = cache.read_cache(file)
        hit = _from_file(file, text, ident, group, path) if text is not None else None
        if not writable:
            file = None
        if hit is not None:
            _STATS["cache_hits"] += 1
            _MEMO[ident] = hit
            return hit[2]
    _STATS["cache_misses"] += 1
    seen = cache.survey(ident, path, group)
    records, rows = _from_importlib(group, path, seen)
    if rows is None or not seen.cacheable:
        _MEMO.pop(ident, None)
        return records
    if seen.newest > time.time_ns() - RACY_WINDOW_NS:
        _STATS["racy_skips"] += 1
        _MEMO.pop(ident, None)
        return records
    _MEMO[ident] = (seen.digest, seen.plan, records)
    text = cache.encode(seen.digest, seen.plan, rows)
    if file is not None and text is not None and cache.write_cache(file, text):
        _STATS["cache_writes"] += 1
    return records


def _from_file(
    file: str, text: str, ident: str, group: str, path: Sequence[str]
) -> tuple[str, cache.Plan, tuple[EntryPointRecord, ...]] | None:
    """The cached answer, if the file is well formed, its key still holds and every record is declared on disk."""
    decoded = cache.decode(text, len(path))
    if decoded is None:
        _reject(f"{file} is not a well-formed cache file")
        return None
    digest, plan, rows = decoded
    if cache.key(ident, path, plan) != digest:
        return None  # the disk changed: an ordinary miss
    texts: dict[tuple[int, str], str | None] = {}
    keyed: dict[int, frozenset[str]] = {}
    records = []
    for name, value, dist, version, idx, child in rows:
        where = (idx, child)
        if where not in texts:
            if idx not in keyed:
                keyed[idx] = frozenset(plan.entries[idx][1])
            listed = f"{child}/entry_points.txt" in keyed[idx]  # so its stat is part of the key just checked
            texts[where] = cache.read_entry_points_text(path[idx], child) if listed else None
        declared = texts[where]
        if declared is None or not cache.declares(declared, group, name, value):
            _reject(f"{file} holds entry point {name!r} = {value!r}, which {path[idx]}/{child} does not declare")
            return None
        records.append(EntryPointRecord(name, value, group, dist, version, path[idx], os.path.join(path[idx], child)))
    return digest, plan, tuple(records)


def _reject(message: str) -> None:
    _STATS["rejected"] += 1
    import logging

    logging.getLogger("attnhost").debug("entry-point cache ignored: %s", message)


def _from_importlib(
    group: str, path: Sequence[str], seen: cache.Survey
) -> tuple[tuple[EntryPointRecord, ...], list[cache.Row] | None]:
    """Ask ``importlib_metadata``, and tie each record to the surveyed metadata directory declaring it.

    The rows are ``None`` when some record cannot be tied to a surveyed
    directory (a zip on the path, a change while we looked): then the answer
    is returned but not cached.
    """
    try:
        import importlib_metadata as md
    except ImportError:  # a broken install; the standard library's copy is the next best
        import importlib.metadata as md  # type: ignore[no-redef]

    import contextlib  # the miss path: importlib_metadata has imported it already

    # Its in-process listing cache is keyed by whole-second mtimes (an instance: 3.11's stdlib copy needs one).
    with contextlib.suppress(Exception):
        md.MetadataPathFinder().invalidate_caches()
    try:
        found = list(md.entry_points(group=group))
    except Exception as exc:  # e.g. an entry_points.txt that is not UTF-8 breaks the whole call
        found = _tolerant_entry_points(md, group, exc)
    index: dict[str, int] = {}
    for i, entry in enumerate(path):
        index.setdefault(os.path.normpath(entry or "."), i)
    records: list[EntryPointRecord] = []
    rows: list[cache.Row] | None = []
    by_dist: dict[int, tuple[int, str] | None] = {}
    for ep in found:
        dist = ep.dist
        name, version, location, where = "", "", "", None
        if dist is not None:
            try:
                name, version = str(dist.name or ""), str(dist.version or "")
            except Exception:  # metadata without Name/Version
                name = version = ""
            location = os.path.normpath(str(dist.locate_file("")))
            idx = index.get(location)
            if idx is not None:
                location = path[idx]
                if id(dist) not in by_dist:
                    by_dist[id(dist)] = _declaring_dir(dist, idx, seen)
                where = by_dist[id(dist)]
        source = os.path.join(path[where[0]], where[1]) if where is not None else ""
        records.append(EntryPointRecord(ep.name, ep.value, group, name, version, location, source))
        if rows is not None:
            if where is None:
                rows = None
            else:
                rows.append((ep.name, ep.value, name, version, where[0], where[1]))
    if list(sys.path) != list(path) and rows is not None:
        rows = None  # sys.path changed under us: the answer may be for either
    return tuple(records), rows


def _declaring_dir(dist: object, idx: int, seen: cache.Survey) -> tuple[int, str] | None:
    """The surveyed metadata directory on entry *idx* whose ``entry_points.txt`` is the one *dist* read."""
    try:
        text = dist.read_text("entry_points.txt")  # type: ignore[attr-defined]
    except Exception:
        return None
    matches = [where for where, seen_text in seen.texts.items() if where[0] == idx and seen_text == text]
    return matches[0] if len(matches) == 1 else None


def _tolerant_entry_points(md: object, group: str, exc: Exception) -> list[object]:
    """One distribution at a time, skipping (with one warning each) those ``importlib_metadata`` cannot read."""
    import logging

    log = logging.getLogger("attnhost")
    log.debug("importlib_metadata.entry_points(group=%r) raised %r; reading distributions one by one", group, exc)
    out: list[object] = []
    seen: set[str] = set()
    for dist in md.distributions():  # type: ignore[attr-defined]
        label = "?"
        try:
            label = f"{dist.name} {dist.version}"
            key = normalize_name(str(dist.name))
            if key in seen:
                continue
            seen.add(key)
            out.extend(ep for ep in dist.entry_points if ep.group == group)
        except Exception as broken:
            log.warning(
                "distribution %s at %s has unreadable metadata (%s: %s), so its entry points are skipped; "
                "reinstall or remove it",
                label,
                dist.locate_file(""),
                type(broken).__name__,
                broken,
            )
    return out
