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
One file per (interpreter, group, path list) under
``$XDG_CACHE_HOME/attnhost/`` (``~/.cache/attnhost/``); its name is a hash of
``sys.executable``, ``sys.version``, ``sys.implementation.cache_tag``,
``sys.prefix``, the group, the exact path list (and the cwd when an entry is
relative), so venvs and groups never fight over one file. It holds the records,
a blake2b-128 digest of the *key*, and the list of things to ``stat`` to
recompute that key. A scan recomputes the key every call and uses the cached
records only if the digest matches.

The key is the interpreter/group/path material above plus ``os.stat``
signatures ``(st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of:

1. every path entry itself (a directory's mtime/ctime change whenever an entry
   is created, removed or renamed in it, so this stands for its listing);
2. for every non-shadowed distribution that is a plugin of the group, its
   ``entry_points.txt`` (catches in-place rewrites, deletion, chmod);
3. for every non-shadowed ``.egg-info`` (and ``EGG-INFO``), plugin or not, its
   ``entry_points.txt`` or, when it has none, the directory itself;
4. the ``METADATA``/``PKG-INFO`` files that were read (for ``PKG-INFO`` or a
   missing file also the directory, where a ``METADATA`` could appear).

Why one stat per plugin, not per distribution: a ``.dist-info`` directory is
written by an installer (pip, uv, installer) and only ever *replaced* as a
whole — install, uninstall, upgrade and even a same-version reinstall remove
and create directories in the path entry, which changes the path entry's own
mtime/ctime (item 1). So a distribution that is not a plugin can only become
one through a change item 1 sees. Only ``.egg-info`` metadata is edited in
place (``setup.py develop``/``egg_info`` rewrite ``entry_points.txt``), so
those keep a stat each. At 1,000 distributions of which 100 are plugins this
is ~200 stats instead of ~1,200, which is what makes a cached scan several
times cheaper than a full one.

Measured at 1,000 distributions on ext4 (2,000 directory entries), per
cached scan: ``os.listdir`` of the path entry ~640 us versus one ``stat`` ~2 us;
a ``stat`` per distribution would be ~1.4 ms (``dir_fd``-relative, 13% cheaper
than full paths). So the listing is represented by the directory's stat, and
each keyed file costs exactly one successful stat (no exception raised for a
missing file, because we remember which one to stat). The stored listing is
re-checked against the directory's stat, never trusted on its own.

Same-second changes: ``st_*time_ns`` are only as fine as the filesystem's clock
tick (jiffies on Linux, 1-2 s on FAT/HFS+), so a file rewritten within one tick
of being cached could keep identical stats. Like git's "racily clean" rule, a
scan whose newest observed ``st_mtime_ns`` *or* ``st_ctime_ns`` is within
:data:`RACY_WINDOW_NS` (3 s) of now, or in the future, is returned but *not
cached*. ``ctime`` is set by the kernel to the real time of every change
(content, rename, chmod, ``utime`` itself) and cannot be forged from user
space, so anything modified after a cache was written carries a ctime newer
than every ctime in that cache's key: the key must change. This holds even for
writers that restore old mtimes (``cp -p``, ``tar``, ``rsync -t``). The price:
a freshly installed environment is parsed normally (a few ms) for 3 s, then
cached. Tests shorten the window by setting :data:`RACY_WINDOW_NS`.

Order matters for correctness and is kept: every stat happens *before* the
listing or file it vouches for is read, so a concurrent change can only cause
a spurious miss, never a stale hit.

The in-process memo holds the last result per cache file name; a repeated
``scan()`` still recomputes the key (the stats above, ~1-2 ms at 1,000
distributions) and so sees an install made since the previous call, but skips
reading and parsing the cache file.

The file is tab-separated text: a magic/schema line, the key digest, the plan
(one line per path entry: kind, stat flags, names; one per metadata file read),
one line per record, and a blake2b checksum of all of it (so a torn or
bit-flipped file is a miss, not wrong records).

``ATTNHOST_NO_CACHE=1`` (``1/true/yes/on``) disables the memo and reading and
writing the file; ``use_cache=`` overrides the environment variable. A corrupt,
truncated, wrong-schema or unreadable cache file, or an unwritable cache
directory, is ignored without a warning and rewritten when possible. Files are
written atomically (unique temporary file + ``os.replace``).

Import cost (measured, ``python -S -X importtime``): ``json`` 6.7 ms (it pulls
in ``re``/``enum``), ``dataclasses`` 12.7 ms (``inspect``), ``hashlib`` 2.6 ms
(OpenSSL), ``tempfile`` 9.4 ms, ``typing`` 8 ms. Hence: a tab-separated text
cache format instead of JSON, a hand-written frozen ``__slots__`` class instead
of a dataclass, ``_blake2`` (0.26 ms) instead of ``hashlib``, ``os.open`` with
``O_EXCL`` instead of ``tempfile``, and type-only imports behind
``TYPE_CHECKING``. This module imports only ``os``, ``sys``, ``stat``, ``time``
and ``_blake2``.
"""

from __future__ import annotations

import marshal
import os
import stat as _stat
import sys
import time

try:
    from _blake2 import blake2b as _blake2b
except ImportError:  # pragma: no cover - CPython always ships _blake2
    from hashlib import blake2b as _blake2b

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

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
#: A scan is not cached while anything it depends on is younger than this.
RACY_WINDOW_NS = 3_000_000_000

_TRUE = frozenset({"1", "true", "yes", "on"})
_MAGIC = "attnhost-entry-points-cache\t1"
_SUFFIXES = (".dist-info", ".egg-info")
_FIELD_BAD = ("\t", "\n", "\r")
_STAT_DIR_FD = os.stat in os.supports_dir_fd
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)

_STATS: dict[str, int] = dict.fromkeys(
    (
        "scans",  # calls to scan()
        "memo_hits",  # answered from the in-process memo
        "cache_hits",  # answered from the cache file
        "cache_misses",  # cache enabled but rebuilt from the environment
        "uncached",  # cache disabled
        "entry_point_files_read",  # entry_points.txt files opened and read
        "metadata_files_read",  # METADATA / PKG-INFO files read
        "cache_writes",  # cache files written
        "racy_skips",  # results not cached because the environment was too fresh
        "importlib_entries",  # path entries delegated to importlib.metadata
    ),
    0,
)
_MEMO: dict[str, tuple[str, _Plan, tuple[EntryPointRecord, ...]]] = {}


class EntryPointRecord:
    """One entry point, as found on disk: immutable, hashable, picklable.

    A hand-written ``__slots__`` class rather than a ``@dataclass(frozen=True,
    slots=True)``: importing ``dataclasses`` costs 5-13 ms (it imports
    ``inspect``), more than a cached scan. It behaves like the frozen dataclass
    would (keyword/positional construction, ``==``, ``hash``, ``repr``,
    assignment raises ``AttributeError``); ``dataclasses.fields()`` does not
    apply. ``distribution`` is the distribution's ``Name:`` header as written
    (unnormalised, like ``importlib``'s ``dist.name``); compare names with
    :func:`normalize_name`. ``extras`` are the ``[extra]`` names of the value.
    """

    __slots__ = ("distribution", "extras", "group", "location", "name", "value", "version")
    __match_args__ = ("name", "value", "group", "distribution", "version", "location")

    name: str
    value: str
    group: str
    distribution: str
    version: str
    location: str
    extras: tuple[str, ...]

    def __init__(
        self,
        name: str,
        value: str,
        group: str,
        distribution: str,
        version: str,
        location: str,
        extras: tuple[str, ...] = (),
    ) -> None:
        setter = object.__setattr__
        setter(self, "name", name)
        setter(self, "value", value)
        setter(self, "group", group)
        setter(self, "distribution", distribution)
        setter(self, "version", version)
        setter(self, "location", location)
        setter(self, "extras", tuple(extras))

    def _astuple(self) -> tuple[str, str, str, str, str, str, tuple[str, ...]]:
        return (self.name, self.value, self.group, self.distribution, self.version, self.location, self.extras)

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
        extras = f", extras={self.extras!r}" if self.extras else ""
        return (
            f"EntryPointRecord(name={self.name!r}, value={self.value!r}, group={self.group!r}, "
            f"distribution={self.distribution!r}, version={self.version!r}, location={self.location!r}{extras})"
        )

    def __reduce__(self) -> tuple[type[EntryPointRecord], tuple[str, str, str, str, str, str, tuple[str, ...]]]:
        return (EntryPointRecord, self._astuple())

    def module(self) -> str:
        """The module part of :attr:`value` (``"pkg.mod"`` of ``"pkg.mod:obj.attr"``)."""
        return self.value.partition(":")[0].strip()

    def attr(self) -> str:
        """The attribute path of :attr:`value` (``"obj.attr"``), ``""`` for a module reference."""
        return self.value.partition(":")[2].strip()

    def load(self) -> object:
        """Import the module and walk the attribute path, as ``EntryPoint.load()`` does.

        Uses ``__import__`` directly so loading never imports ``importlib.metadata``.
        Raises ``ValueError`` for a value that is not ``module[:attr]``, and
        whatever the import or attribute lookup raises.
        """
        parsed = _split_value(self.value)
        if parsed is None:
            raise ValueError(f"malformed entry point value {self.value!r} for {self.name!r}")
        module, attr, _ = parsed
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
            "extras": list(self.extras),
        }


# --------------------------------------------------------------------------- helpers


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: lower case, runs of ``-_.`` become one ``-`` (no ``re`` import)."""
    s = name.lower().replace("_", "-").replace(".", "-")
    while "--" in s:
        s = s.replace("--", "-")
    return s


def _is_word(s: str) -> bool:
    """``re.fullmatch(r"[\\w.]+", s)``, near enough (``str.isalnum`` ~ ``\\w``)."""
    return bool(s) and s.replace("_", "a").replace(".", "a").isalnum()


def _split_value(value: str) -> tuple[str, str, tuple[str, ...]] | None:
    """Split like ``EntryPoint.pattern``: ``module [: attr] [[extras]]``; None if it does not match."""
    head, bracket, tail = value.partition("[")
    extras: tuple[str, ...] = ()
    if bracket:
        tail = tail.rstrip()
        if not tail.endswith("]"):
            return None
        # re.findall(r"\w+", extras) without re.
        words, cur = [], []
        for ch in tail[:-1]:
            if ch.isalnum() or ch == "_":
                cur.append(ch)
            elif cur:
                words.append("".join(cur))
                cur = []
        if cur:
            words.append("".join(cur))
        extras = tuple(words)
    module, colon, attr = head.partition(":")
    # The pattern allows whitespace only after the module, around ':' and after attr.
    if module != module.lstrip():
        return None
    module, attr = module.rstrip(), attr.strip()
    if not _is_word(module) or (colon and not _is_word(attr)):
        return None
    return module, attr, extras


def _parse_entry_points(text: str, group: str) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs of *group* in an ``entry_points.txt`` text."""
    pairs: list[tuple[str, str]] = []
    inside = False
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line[0] == "[" and line[-1] == "]":
            inside = line.strip("[]") == group
        elif inside:
            name, eq, value = line.partition("=")
            if eq:
                pairs.append((name.strip(), value.strip()))
    return pairs


def _read_text(path: str, dir_fd: int | None) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with open(fd, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, ValueError):
        return None


def _parse_headers(data: bytes, eof: bool) -> tuple[str | None, str | None, bool]:
    """``Name``/``Version`` from the complete header lines in *data*; True when no more data can matter."""
    lines = data.decode("utf-8", "replace").split("\n")
    if not eof:
        lines.pop()  # possibly cut mid-line
    name = version = None
    for line in lines:
        line = line.rstrip("\r")
        if not line:
            return name, version, True  # end of the header block
        key, colon, val = line.partition(":")
        if not colon or key[:1] in (" ", "\t"):
            continue
        key = key.strip().lower()
        if key == "name" and name is None:
            name = val.strip()
        elif key == "version" and version is None:
            version = val.strip()
        if name is not None and version is not None:
            return name, version, True
    return name, version, eof


def _read_headers(path: str, dir_fd: int | None) -> tuple[str | None, str | None]:
    """``Name`` and ``Version`` of an email-style metadata file (first occurrence wins, like ``email``).

    Reads the first 8 KiB only, unless the headers run longer: a ``METADATA``
    with a long description can be tens of KiB, of which we need two lines.
    """
    _STATS["metadata_files_read"] += 1
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except (OSError, ValueError):
        return None, None
    try:
        data = os.read(fd, 8192)
        name, version, done = _parse_headers(data, eof=len(data) < 8192)
        while not done:
            chunk = os.read(fd, 65536)
            data += chunk
            name, version, done = _parse_headers(data, eof=not chunk)
        return name, version
    except OSError:
        return None, None
    finally:
        os.close(fd)


_Sig = tuple[int, ...]


def _sig(path: str, dir_fd: int | None = None) -> _Sig:
    """``(st_ino, st_size, st_mtime_ns, st_ctime_ns)``, or ``()`` if the stat failed."""
    try:
        st = os.stat(path, dir_fd=dir_fd)
    except (OSError, ValueError):
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _lookup_order(entry: str, children: Iterable[str]) -> list[str]:
    """Metadata directories of one path entry, in ``importlib``'s ``Lookup`` order."""
    groups: dict[str, list[str]] = {}
    eggs: list[str] = []
    base_is_egg = os.path.basename(entry).lower().endswith(".egg")
    for child in children:
        if child.endswith(_SUFFIXES) or (child[-1:] in "oO" and child.lower().endswith(_SUFFIXES)):
            key = normalize_name(child.lower().rpartition(".")[0].partition("-")[0])
            members = groups.get(key)
            if members is None:
                groups[key] = [child]
            else:
                members.append(child)
        elif base_is_egg and child.lower() == "egg-info":
            eggs.append(child)
    if len(groups) == 1:
        ordered = next(iter(groups.values()))
    else:
        ordered = [child for members in groups.values() for child in members]
    return ordered + eggs if eggs else ordered


def _stem_name(child: str) -> str | None:
    """``PathDistribution._name_from_stem``: the name part, if the suffix is exact and the name non-empty."""
    if child.endswith(_SUFFIXES):
        name = child.rpartition(".")[0].partition("-")[0]
        if name:
            return name
    return None


def _env_cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in _TRUE


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/attnhost`` (if set and absolute, per the XDG spec), else ``~/.cache/attnhost``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnhost")


def _identity(group: str, path: Sequence[str]) -> str:
    """Everything except the filesystem state that the result depends on."""
    parts = [_MAGIC, sys.executable, sys.version, str(sys.implementation.cache_tag), sys.prefix, group]
    if any(not os.path.isabs(p) for p in path):
        try:
            parts.append("cwd=" + os.getcwd())
        except OSError:
            parts.append("cwd=?")
    parts.append(str(len(path)))
    parts.extend(path)
    return "\0".join(parts)


def _hash(text: str) -> str:
    return _blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _digest(material: list[object]) -> str:
    """Digest of the key material. ``marshal`` format 2 is deterministic (no
    back-references) and ~4x cheaper than formatting strings; it only has to be
    stable within one interpreter version, which is part of the key."""
    return _blake2b(marshal.dumps(material, 2), digest_size=16).hexdigest()


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


# --------------------------------------------------------------------------- the scan


class _Plan:
    """What to stat to recompute the key, as built by a full scan and stored in the cache.

    ``entries[i]`` is ``(kind, names, flags)`` for path entry *i*: kind ``d``
    (directory), ``f`` (file, handed to importlib), ``m`` (missing/other);
    *names* the non-shadowed metadata directories in scan order; *flags* one
    character each, ``1`` = stat its ``entry_points.txt``, ``0`` = stat the
    directory, ``-`` = nothing (a non-plugin ``.dist-info``: the path entry's
    stat vouches for it). ``extras`` are ``(entry index, metadata dir, file)`` triples of
    metadata files that were read (file ``""`` when none existed).
    """

    __slots__ = ("_targets", "entries", "extras")

    def __init__(self) -> None:
        self.entries: list[tuple[str, list[str], str]] = []
        self.extras: list[tuple[int, str, str]] = []
        self._targets: list[list[str]] | None = None

    def targets(self) -> list[list[str]]:
        """Per entry, the names to stat relative to the entry (computed once per plan)."""
        if self._targets is None:
            self._targets = [
                [
                    f"{name}/entry_points.txt" if flag == "1" else name
                    for name, flag in zip(names, flags, strict=True)
                    if flag != "-"
                ]
                for _, names, flags in self.entries
            ]
        return self._targets


class _Scope:
    """An open path entry: stat/read relative to a directory fd where the platform allows it.

    ``dir_fd``-relative stats are ~13% cheaper than full paths (shorter path
    walk, shorter string to encode) and pin the directory for the whole pass.
    """

    __slots__ = ("fd", "prefix")

    def __init__(self, entry: str) -> None:
        self.fd: int | None = None
        self.prefix = entry + os.sep if entry and not entry.endswith(os.sep) else entry
        if _STAT_DIR_FD:
            try:
                self.fd = os.open(entry or ".", _O_DIR)
            except (OSError, ValueError):
                self.fd = None
            else:
                self.prefix = ""

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _edited_in_place(child: str) -> bool:
    """Whether a metadata directory may be edited in place rather than replaced.

    ``.egg-info`` directories are rewritten in place by ``setup.py develop`` /
    ``egg_info``; a ``.dist-info`` is written by an installer and only ever
    replaced as a whole (uninstall + install, even for a same-version reinstall).
    """
    return not child.lower().endswith(".dist-info")


def _entry_kind(entry: str) -> tuple[str, _Sig]:
    """Kind (``d``/``f``/``m``) and stat signature of a path entry."""
    try:
        st = os.stat(entry or ".")
    except (OSError, ValueError):
        return "m", ()
    sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if _stat.S_ISDIR(st.st_mode):
        return "d", sig
    if _stat.S_ISREG(st.st_mode):
        return "f", sig
    return "m", sig


def _extra_item(path: Sequence[str], idx: int, name: str, fname: str) -> tuple[object, ...]:
    """Key material for a metadata file that was read.

    ``METADATA``: its own stat (it wins over any other file). ``PKG-INFO`` or
    none: the directory's stat too, since a ``METADATA`` appearing would win.
    """
    prefix = path[idx] + os.sep if path[idx] else ""
    file_sig = _sig(f"{prefix}{name}/{fname}") if fname else ()
    dir_sig = () if fname == "METADATA" else _sig(prefix + name)
    return (idx, name, fname, dir_sig, file_sig)


def _key_for_plan(identity: str, path: Sequence[str], plan: _Plan) -> str | None:
    """Recompute the key digest following a stored plan (the cache-hit path).

    Every stat in a stored plan succeeded when it was built, so a failing one
    means the environment changed: return None (a miss) at once.
    """
    if len(plan.entries) != len(path):
        return None
    material: list[object] = [identity]
    add = material.append
    stat = os.stat
    all_targets = plan.targets()
    for idx, entry in enumerate(path):
        kind, names, flags = plan.entries[idx]
        add((idx, *_entry_kind(entry)))
        if kind != "d" or not names:
            continue
        scope = _Scope(entry)
        fd, prefix = scope.fd, scope.prefix
        targets = all_targets[idx] if not prefix else [prefix + t for t in all_targets[idx]]
        try:
            sts = [stat(t, dir_fd=fd) for t in targets]
        except (OSError, ValueError):
            return None
        finally:
            scope.close()
        add(("\0".join(names), flags, [(s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in sts]))
    for idx, name, fname in plan.extras:
        if not 0 <= idx < len(path):
            return None
        add(_extra_item(path, idx, name, fname))
    return _digest(material)


class _Builder:
    """One full scan of the environment; with ``keyed`` also builds the plan and key material.

    Key material is laid out exactly as :func:`_key_for_plan` recomputes it.
    """

    def __init__(self, group: str, path: Sequence[str], identity: str, keyed: bool) -> None:
        self.group = group
        self.path = path
        self.keyed = keyed
        self.material: list[object] = [identity]
        # Metadata-file stats go last, in the order the hit path recomputes them.
        self.extra_material: list[object] = []
        self.plan = _Plan()
        self.newest = 0
        self.cacheable = True
        self.records: list[EntryPointRecord] = []
        self.seen: set[str] = set()

    def digest(self) -> str:
        return _digest(self.material + self.extra_material)

    def _note(self, sig: _Sig) -> None:
        """Track the newest mtime/ctime seen (for the racy-cache rule)."""
        if sig:
            newest = sig[2] if sig[2] > sig[3] else sig[3]
            if newest > self.newest:
                self.newest = newest

    def run(self) -> None:
        for idx, entry in enumerate(self.path):
            if self.keyed:
                kind, sig = _entry_kind(entry)
                self.material.append((idx, kind, sig))
                self._note(sig)
            else:
                kind = "d"
            if kind == "d":
                self._scan_dir(idx, entry)
            elif kind == "f":
                self.plan.entries.append(("f", [], ""))
                self._scan_with_importlib(entry)
            else:
                self.plan.entries.append(("m", [], ""))

    def _metadata(self, idx: int, entry: str, child: str, scope: _Scope) -> tuple[str | None, str | None]:
        """Name/Version headers of a metadata dir (``METADATA``, else ``PKG-INFO``), stat'd into the key first."""
        base = scope.prefix + child
        fname = ""
        for candidate in ("METADATA", "PKG-INFO"):
            if _sig(f"{base}/{candidate}", scope.fd):
                fname = candidate
                break
        if self.keyed:
            item = _extra_item(self.path, idx, child, fname)
            self.extra_material.append(item)
            self.plan.extras.append((idx, child, fname))
            for sig in item[3:]:
                assert isinstance(sig, tuple)
                self._note(sig)
        if not fname:
            return None, None
        return _read_headers(f"{base}/{fname}", scope.fd)

    def _scan_dir(self, idx: int, entry: str) -> None:
        scope = _Scope(entry)
        names: list[str] = []
        flags: list[str] = []
        sigs: list[_Sig] = []
        try:
            try:
                children = os.listdir(scope.fd if scope.fd is not None else (entry or "."))
            except (OSError, ValueError):
                children = []
                if not self.keyed and _entry_kind(entry)[0] == "f":
                    # Uncached mode did not stat the entry first: it may be a zip file.
                    self._scan_with_importlib(entry)
                    return
            for child in _lookup_order(entry, children):
                stem = _stem_name(child)
                if stem is not None:
                    dedupe: str | None = normalize_name(stem)
                    headers = None
                else:
                    headers = self._metadata(idx, entry, child, scope)
                    dedupe = normalize_name(headers[0]) if headers[0] else None
                if dedupe is not None:
                    if dedupe in self.seen:
                        continue
                    self.seen.add(dedupe)
                ep_path = f"{scope.prefix}{child}/entry_points.txt"
                if self.keyed:
                    # Stat before reading: a change after this point can only cause a miss later.
                    sig = _sig(ep_path, scope.fd)
                    flag = "1"
                    if not sig:
                        flag = "0"
                        sig = _sig(scope.prefix + child, scope.fd)
                        if not sig:  # vanished while we looked: answer, but do not cache
                            self.cacheable = False
                    names.append(child)
                    self._note(sig)
                    if flag == "0":
                        # An installer-managed .dist-info is replaced, never edited: the path
                        # entry's own stat vouches for it (see "Why one stat per plugin").
                        flags.append("0" if _edited_in_place(child) else "-")
                        sigs.append(sig)
                        continue
                text = _read_text(ep_path, scope.fd)
                pairs = []
                if text is not None:
                    _STATS["entry_point_files_read"] += 1
                    if self.group in text:
                        pairs = _parse_entry_points(text, self.group)
                if pairs:
                    self._add(idx, entry, child, stem, headers, pairs, scope)
                if self.keyed:
                    flags.append("1" if pairs or _edited_in_place(child) else "-")
                    sigs.append(sig)
        finally:
            scope.close()
            self.plan.entries.append(("d", names, "".join(flags)))
            if self.keyed and names:
                kept = [sig for sig, flag in zip(sigs, flags, strict=True) if flag != "-"]
                self.material.append(("\0".join(names), "".join(flags), kept))

    def _add(
        self,
        idx: int,
        entry: str,
        child: str,
        stem: str | None,
        headers: tuple[str | None, str | None] | None,
        pairs: list[tuple[str, str]],
        scope: _Scope,
    ) -> None:
        # Name/Version as importlib's dist.name/dist.version report them (users see
        # "acme-attention", not the escaped "acme_attention" of the directory name).
        if headers is None:
            headers = self._metadata(idx, entry, child, scope)
        dist, _, version = child.rpartition(".")[0].partition("-")
        dist = headers[0] or stem or dist
        version = headers[1] or (version if child.endswith(".dist-info") else "")
        for name, value in pairs:
            parsed = _split_value(value)
            extras: tuple[str, ...] = ()
            if parsed is None:
                canonical = value
            else:
                module, attr, extras = parsed
                canonical = f"{module}:{attr}" if attr else module
            self.records.append(EntryPointRecord(name, canonical, self.group, dist, version, entry, extras))

    def _scan_with_importlib(self, entry: str) -> None:
        """A zip/egg file on the path: let importlib.metadata read it (imported only now)."""
        _STATS["importlib_entries"] += 1
        try:
            import importlib.metadata as md

            for dist in md.distributions(path=[entry]):
                self._add_importlib_dist(dist, entry)
        except Exception:  # a broken zip on sys.path must not break discovery
            return

    def _add_importlib_dist(self, dist: object, location: str) -> None:
        try:
            norm = getattr(dist, "_normalized_name", None)
            meta = dist.metadata  # type: ignore[attr-defined]
            name = meta["Name"]
            if not isinstance(norm, str) or not norm:
                norm = name if isinstance(name, str) else None
            if norm is not None:
                key = normalize_name(norm)
                if key in self.seen:
                    return
                self.seen.add(key)
            version = meta["Version"] or ""
            for ep in dist.entry_points:  # type: ignore[attr-defined]
                if ep.group != self.group:
                    continue
                try:
                    module, attr, extras = ep.module, ep.attr, tuple(ep.extras)
                    value = f"{module}:{attr}" if attr else module
                except Exception:  # value importlib cannot parse: keep it verbatim
                    value, extras = ep.value, ()
                self.records.append(
                    EntryPointRecord(ep.name, value, self.group, str(name or ""), str(version), location, extras)
                )
        except Exception:
            return


def _has_custom_distribution_finder() -> bool:
    """Whether ``sys.meta_path`` has a distribution finder besides the standard ``PathFinder``."""
    # The frozen bootstrap module is always loaded; importing importlib.machinery would not be (-S).
    path_finder = getattr(sys.modules.get("_frozen_importlib_external"), "PathFinder", None)
    for finder in sys.meta_path:
        if finder is not path_finder and getattr(finder, "find_distributions", None) is not None:
            return True
    return False


def _scan_all_with_importlib(group: str, path: Sequence[str]) -> tuple[EntryPointRecord, ...]:
    """Whole-scan fallback when a custom distribution finder is installed."""
    _STATS["importlib_entries"] += len(path)
    builder = _Builder(group, path, "", keyed=False)
    try:
        import importlib.metadata as md

        for dist in md.distributions(path=list(path)):
            dist_path = getattr(dist, "_path", None)
            location = str(getattr(dist_path, "parent", "")) if dist_path is not None else ""
            builder._add_importlib_dist(dist, location)
    except Exception:
        pass
    return tuple(builder.records)


# --------------------------------------------------------------------------- cache file


def _serialise(digest: str, plan: _Plan, records: Sequence[EntryPointRecord], path: Sequence[str]) -> str | None:
    """Tab-separated text; None if some field cannot be stored unambiguously (then we just don't cache)."""
    index = {entry: i for i, entry in reversed(list(enumerate(path)))}
    lines = [_MAGIC, "K\t" + digest]
    for kind, names, flags in plan.entries:
        lines.append("\t".join(["P", kind, flags, *names]))
    for idx, name, fname in plan.extras:
        lines.append(f"X\t{idx}\t{name}\t{fname}")
    for r in records:
        loc = index.get(r.location)
        if loc is None:
            return None
        lines.append("\t".join(["R", r.name, r.value, r.distribution, r.version, str(loc), ",".join(r.extras)]))
    body = "\n".join(lines)
    for record in records:
        for value in record._astuple()[:6]:
            if any(bad in value for bad in _FIELD_BAD):
                return None
    for _, names, _ in plan.entries:
        for name in names:
            if any(bad in name for bad in _FIELD_BAD):
                return None
    # The key digest vouches for the environment; this checksum for the file's own bytes.
    return f"{body}\nS\t{_hash(body)}\nE\n"


def _deserialise(text: str, group: str, path: Sequence[str]) -> tuple[str, _Plan, tuple[EntryPointRecord, ...]] | None:
    if not text.startswith(_MAGIC + "\nK\t") or not text.endswith("\nE\n"):
        return None
    body, sep, checksum = text[:-3].rpartition("\nS\t")
    if not sep or checksum != _hash(body):
        return None
    lines = body.split("\n")
    digest = lines[1][2:]
    plan = _Plan()
    records: list[EntryPointRecord] = []
    n = len(path)
    for line in lines[2:]:
        fields = line.split("\t")
        tag = fields[0]
        if tag == "P" and len(fields) >= 3:
            kind, flags, names = fields[1], fields[2], fields[3:]
            if len(flags) != len(names) or kind not in ("d", "f", "m"):
                return None
            plan.entries.append((kind, names, flags))
        elif tag == "X" and len(fields) == 4:
            plan.extras.append((int(fields[1]), fields[2], fields[3]))
        elif tag == "R" and len(fields) == 7:
            loc = int(fields[5])
            if not 0 <= loc < n:
                return None
            extras = tuple(fields[6].split(",")) if fields[6] else ()
            records.append(EntryPointRecord(fields[1], fields[2], group, fields[3], fields[4], path[loc], extras))
        else:
            return None
    if len(plan.entries) != n or len(digest) != 32:
        return None
    return digest, plan, tuple(records)


def _read_cache(file: str, group: str, path: Sequence[str]) -> tuple[str, _Plan, tuple[EntryPointRecord, ...]] | None:
    try:
        with open(file, "rb") as f:
            data = f.read()
        return _deserialise(data.decode("utf-8"), group, path)
    except Exception:  # any unreadable/corrupt cache is just a miss
        return None


def _write_cache(file: str, text: str) -> None:
    directory = os.path.dirname(file)
    tmp = f"{file}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, file)
        _STATS["cache_writes"] += 1
    except Exception:  # an unwritable cache dir must not break discovery
        try:  # noqa: SIM105 - contextlib.suppress would cost an import
            os.unlink(tmp)
        except OSError:
            pass


# --------------------------------------------------------------------------- public entry point


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
        return _scan_all_with_importlib(group, entries)
    enabled = _env_cache_enabled() if use_cache is None else use_cache
    identity = _identity(group, entries)
    if not enabled:
        _STATS["uncached"] += 1
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
