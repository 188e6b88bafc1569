"""Entry-point discovery for one group, without importing ``importlib.metadata``, with a correct cache.

Why this exists
---------------
Every serving process and every ``attnhost`` CLI call discovers plugins. The
obvious ``importlib.metadata.entry_points(group=...)`` costs ~15 ms just to
import (email, zipfile, csv, pathlib, re...) and then opens every
``entry_points.txt`` of every installed distribution through ``pathlib``. This
module gives the same answer from ``os.listdir``/``os.stat``/``open`` alone and
caches it on disk, keyed so that no install, removal, upgrade or reinstall can
be missed (stevedore's cache keys on path mtimes packed into 32-bit floats and
so misses changes made within ~2 minutes of each other; this one does not).

Semantics (what :func:`scan` returns)
-------------------------------------
The same entry points, in the same order, as ``importlib.metadata.entry_points(
group=group)`` (Python 3.11) on the same path list:

* each *directory* path entry is listed; children whose lower-cased name ends
  with ``.dist-info`` or ``.egg-info`` (and ``EGG-INFO`` inside a ``*.egg``
  directory) are distributions, visited in ``importlib``'s order: grouped by
  normalised name in order of first appearance in ``os.listdir`` order, the
  ``EGG-INFO`` of an egg directory last. ``os.listdir`` order is what the
  filesystem returns: stable for an unchanged directory, not sorted. We keep it
  (rather than sorting) so results equal ``importlib``'s element for element;
  callers wanting a presentation order should sort (``attnhost.discovery`` does).
* a distribution whose normalised name (PEP 503 on the metadata directory's
  name part; ``METADATA`` ``Name`` when that is empty or the suffix is not
  lower case, exactly like ``PathDistribution._normalized_name``) was already
  seen on an earlier path entry, or earlier in the same entry, is shadowed.
* ``entry_points.txt`` is parsed like ``importlib``'s ``Sectioned``: lines are
  stripped; ``[x]`` lines open section ``x.strip("[]")``; ``name = value``
  pairs split at the first ``=``. Differences, all where ``importlib`` would
  crash or produce nonsense: lines starting with ``;`` are comments (as in the
  entry-points specification / configparser; ``importlib`` only knows ``#``),
  a line without ``=`` is skipped (``importlib`` raises ``TypeError``), and a
  file that is not UTF-8 contributes nothing (``importlib`` raises
  ``UnicodeDecodeError``). Unreadable files contribute nothing in both.
* ``EntryPointRecord.value`` is the canonical ``module`` / ``module:attr``
  (whitespace around ``:`` and an ``[extras]`` suffix removed, like
  ``EntryPoint.module``/``.attr`` do); extras are kept in ``.extras``. A value
  ``importlib``'s pattern does not match is kept verbatim (``load()`` fails).
* ``distribution``/``version`` are the ``Name:``/``Version:`` headers of
  ``METADATA`` (else ``PKG-INFO``), i.e. ``dist.name``/``dist.version`` as
  ``importlib`` reports them (unnormalised: ``acme-attention``, not the
  directory's escaped ``acme_attention``; compare with :func:`normalize_name`).
  Only distributions that contribute entry points to the group pay that read
  (its first 8 KiB), and the cache stores the answer. When the headers are
  missing, the name and version parts of the ``{name}-{version}.dist-info``
  directory name are used.
* ``location`` is the path entry the distribution was found on.
* non-directory path entries (zip files, zipped eggs) are handed to
  ``importlib.metadata`` (imported lazily, only then) for just that entry; a
  missing entry contributes nothing; nothing here ever raises for a broken
  environment. If ``sys.meta_path`` holds a finder other than ``PathFinder``
  that implements ``find_distributions`` (custom distribution finders are
  rare), we cannot replicate it and delegate the whole scan to
  ``importlib.metadata`` (uncached).

The cache
---------
With the cache enabled, a scan is answered from a file under
``$XDG_CACHE_HOME/attnhost/`` (``~/.cache/attnhost/``) whenever a key made of
the interpreter, the group, the path list and ``os.stat`` signatures of what
the result depends on still matches; the key is recomputed on every call, so
no install, removal, upgrade or reinstall can be missed. A scan of an
environment changed within :data:`RACY_WINDOW_NS` (3 s) is returned but not
cached. The design, and why the key is correct, is in :mod:`attnhost._ep_cache`.

The in-process memo holds the last result per cache file name; a repeated
``scan()`` still recomputes the key (its stats cost ~1-2 ms at 1,000
distributions) and so sees an install made since the previous call, but skips
reading and parsing the cache file.

``ATTNHOST_NO_CACHE=1`` (``1/true/yes/on``) disables the memo and reading and
writing the file; ``use_cache=`` overrides the environment variable.

Layout: this module is the public API and the memo/cache/scan decision in
:func:`scan`; :mod:`attnhost._ep_scan` reads the environment,
:mod:`attnhost._ep_cache` keys, reads and writes the cache, and
:mod:`attnhost._ep_record` holds :class:`EntryPointRecord` (a leaf, so the
other two can build records without importing this module). ``_ep_scan`` is
imported only when the memo and the cache file cannot answer, so a cached
scan (every ``attnhost list`` after the first) never loads it.

Import cost (measured, ``python -S -X importtime``): ``json`` 6.7 ms (it pulls
in ``re``/``enum``), ``dataclasses`` 12.7 ms (``inspect``), ``hashlib`` 2.6 ms
(OpenSSL), ``tempfile`` 9.4 ms, ``typing`` 8 ms. Hence: a tab-separated text
cache format instead of JSON, a hand-written frozen ``__slots__`` class instead
of a dataclass, ``_blake2`` (0.26 ms) instead of ``hashlib``, ``os.open`` with
``O_EXCL`` instead of ``tempfile``, and type-only imports behind
``TYPE_CHECKING``. These modules import only ``os``, ``sys``, ``stat``,
``time``, ``marshal`` and ``_blake2``.
"""

from __future__ import annotations

import os
import sys
import time

from attnhost._ep_cache import _STATS, _hash, _identity, _key_for_plan, _Plan, _read_cache, _serialise, _write_cache
from attnhost._ep_record import EntryPointRecord, normalize_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "NO_CACHE_ENV",
    "RACY_WINDOW_NS",
    "EntryPointRecord",
    "cache_dir",
    "cache_file",
    "clear_memo",
    "normalize_name",
    "reset_scan_stats",
    "scan",
    "scan_stats",
]

NO_CACHE_ENV = "ATTNHOST_NO_CACHE"
#: A scan is not cached while anything it depends on is younger than this. Read by
#: :func:`scan` at call time from this module (tests lower it here).
RACY_WINDOW_NS = 3_000_000_000

_TRUE = frozenset({"1", "true", "yes", "on"})

_MEMO: dict[str, tuple[str, _Plan, tuple[EntryPointRecord, ...]]] = {}


def _env_cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in _TRUE


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/attnhost`` (if set and absolute, per the XDG spec), else ``~/.cache/attnhost``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnhost")


def cache_file(group: str, path: Sequence[str] | None = None) -> str:
    """The cache file :func:`scan` would use for *group* on *path* (default ``sys.path``)."""
    return os.path.join(cache_dir(), f"entry-points-{_hash(_identity(group, _paths(path)))}.txt")


def _paths(path: Sequence[str] | None) -> list[str]:
    entries = sys.path if path is None else path
    out: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            out.append(entry)
        else:
            try:
                fs = os.fspath(entry)
            except TypeError:
                continue
            if isinstance(fs, str):
                out.append(fs)
    return out


def scan_stats() -> dict[str, int]:
    """Counters of what :func:`scan` did in this process (a copy). Tests use them to prove cache hits."""
    return dict(_STATS)


def reset_scan_stats() -> None:
    """Zero the counters returned by :func:`scan_stats`."""
    for key in _STATS:
        _STATS[key] = 0


def clear_memo() -> None:
    """Forget in-process results, so the next :func:`scan` consults the cache file."""
    _MEMO.clear()


def _has_custom_distribution_finder() -> bool:
    """Whether ``sys.meta_path`` has a distribution finder besides the standard ``PathFinder``."""
    # The frozen bootstrap module is always loaded; importing importlib.machinery would not be (-S).
    path_finder = getattr(sys.modules.get("_frozen_importlib_external"), "PathFinder", None)
    for finder in sys.meta_path:
        if finder is not path_finder and getattr(finder, "find_distributions", None) is not None:
            return True
    return False


def scan(
    group: str, *, path: Sequence[str] | None = None, use_cache: bool | None = None
) -> tuple[EntryPointRecord, ...]:
    """The entry points of *group* on *path* (default: the current ``sys.path``).

    Same answer and order as ``importlib.metadata.entry_points(group=group)``
    (see the module docstring for the few deliberate differences). With the
    cache enabled (default; ``ATTNHOST_NO_CACHE=1`` or ``use_cache=False``
    disable it, ``use_cache=True`` forces it on) the key is recomputed on
    every call, so an install made since the previous call is always seen.
    Never raises because of the environment or the cache.
    """
    _STATS["scans"] += 1
    entries = _paths(path)
    if _has_custom_distribution_finder():
        from attnhost._ep_scan import _scan_all_with_importlib

        return _scan_all_with_importlib(group, entries)
    enabled = _env_cache_enabled() if use_cache is None else use_cache
    identity = _identity(group, entries)
    if not enabled:
        _STATS["uncached"] += 1
        from attnhost._ep_scan import _Builder

        builder = _Builder(group, entries, identity, keyed=False)
        builder.run()
        return tuple(builder.records)

    name = _hash(identity)
    memo = _MEMO.get(name)
    if memo is not None and _key_for_plan(identity, entries, memo[1]) == memo[0]:
        _STATS["memo_hits"] += 1
        return memo[2]
    file = os.path.join(cache_dir(), f"entry-points-{name}.txt")
    cached = _read_cache(file, group, entries)
    if cached is not None and _key_for_plan(identity, entries, cached[1]) == cached[0]:
        _STATS["cache_hits"] += 1
        _MEMO[name] = cached
        return cached[2]

    _STATS["cache_misses"] += 1
    from attnhost._ep_scan import _Builder

    builder = _Builder(group, entries, identity, keyed=True)
    builder.run()
    records = tuple(builder.records)
    if not builder.cacheable:
        return records
    if builder.newest > time.time_ns() - RACY_WINDOW_NS:
        _STATS["racy_skips"] += 1
        _MEMO.pop(name, None)
        return records
    digest = builder.digest()
    _MEMO[name] = (digest, builder.plan, records)
    text = _serialise(digest, builder.plan, records, entries)
    if text is not None:
        _write_cache(file, text)
    return records
