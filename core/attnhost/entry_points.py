"""Entry points of one group: answered by ``importlib_metadata``, remembered by an on-disk cache that checks itself.

A cache hit imports neither ``importlib.metadata`` nor ``importlib_metadata`` (most of every ``attnhost`` start-up)
and returns a record only while its ``entry_points.txt`` declares it. The key digests :func:`identity` and
``(mode, dev, ino, size, mtime_ns, ctime_ns)`` of each path entry, of every metadata directory in it (moved when a
file is added or removed), of its ``entry_points.txt`` and, if that mentions the group, its ``METADATA`` /
``PKG-INFO``, all statted before ``importlib_metadata`` reads. The kernel sets ctime to now on every change, so an
in-place edit is seen; and as nothing younger than ``RACY_WINDOW_NS`` is cached, nor is a change racing the survey.
Blind spots: (a) a filesystem keeping neither ctime nor mtime; (b) the clock stepped back by more than the racy
window; (c) an in-place edit of the ``METADATA`` of a distribution whose ``entry_points.txt`` does not mention the
group and whose directory name carries no name, renaming it to shadow a plugin; (d) a custom finder on
``sys.meta_path`` (then no cache is used); (e) a cache file rewritten to leave out both a plugin's rows and its
``METADATA`` from the plan hides that plugin (it can hide, never add: each row is checked by :func:`chosen`).
A cache file or directory that is not the user's alone is ignored (:func:`read_cache`), with one debug line.
"""

from __future__ import annotations

import marshal
import os
import stat
import sys
import time

try:
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - CPython ships _blake2
    from hashlib import blake2b

__all__ = ["RACY_WINDOW_NS", "EntryPointRecord", "clear_memo", "normalize_name", "reset_scan_stats", "scan"]
__all__ += ["scan_stats"]

#: A scan is not cached while anything in its key is younger than this (read at call time; tests lower it).
RACY_WINDOW_NS = 3_000_000_000
MAGIC = "attnhost-entry-points-cache\t2"
MAX_CACHE_BYTES = 16 << 20
_SUFFIXES = (".dist-info", ".egg-info")
MAX_TEXT_BYTES = 1 << 20  # an entry_points.txt larger than this is not read (for the key or a hit's check)

Plan = list[tuple[str, ...]]  # per path entry, the names under it (child or child/file) in the key
Row = tuple[str, str, str, str, int, str]  # name, value, distribution, version, path entry index, metadata dir
Stored = tuple[str, Plan, list[Row]]  # what a cache file holds: the key's digest, the plan, the records
_Answer = tuple[str, Plan, tuple["EntryPointRecord", ...]]  # what the memo holds: the records instead of rows

#: What :func:`scan` did in this process: tests prove hits with it, benchmarks that the cache engaged.
_STATS = dict.fromkeys(
    ("scans", "memo_hits", "cache_hits", "cache_misses", "uncached", "cache_writes", "racy_skips", "rejected"), 0
)
_MEMO: dict[str, _Answer] = {}
_STANDARD_FINDERS = {("_frozen_importlib_external", "PathFinder"), ("importlib_metadata", "MetadataPathFinder")}


def _field(index: int) -> str:
    """A field by name, as ``namedtuple`` makes them: a property, typed as what an instance reads."""
    return property(lambda record: record[index])  # type: ignore[return-value]


class EntryPointRecord(tuple[str, str, str, str, str, str, str]):
    """An entry point with its distribution's ``Name``/``Version``, ``sys.path`` entry and metadata directory
    (``""`` if none): an immutable tuple with named fields, as ``namedtuple`` makes (importing ``collections``,
    ``typing`` or ``dataclasses`` would cost more than a hit)."""

    __slots__ = ()
    name, value, group, distribution, version, location, source = map(_field, range(7))

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


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: lower case, runs of ``-_.`` become one ``-``."""
    return _norm(name).replace("_", "-")


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
    """``importlib_metadata.entry_points(group=group)`` on ``sys.path``, from the cache while its key holds; the host
    passes ``use_cache`` from its settings (``ATTNHOST_NO_CACHE``), as reading them here would import more."""
    _STATS["scans"] += 1
    path = _paths()
    ident = identity(group, path)
    finders = (f if isinstance(f, type) else type(f) for f in sys.meta_path if hasattr(f, "find_distributions"))
    if not use_cache or any((cls.__module__, cls.__name__) not in _STANDARD_FINDERS for cls in finders):
        _STATS["uncached"] += 1
        return _from_importlib(group, path)[0]
    memo = _MEMO.get(ident)
    if memo is not None and key(ident, path, memo[1])[0] == memo[0]:
        _STATS["memo_hits"] += 1
        return memo[2]
    file = cache_file(ident)
    stored, writable = (None, False) if file is None else read_cache(file, len(path))
    hit = None if stored is None else _verified(stored, ident, group, path)
    if hit is not None:
        _STATS["cache_hits"] += 1
        _MEMO[ident] = hit
        return hit[2]
    _STATS["cache_misses"] += 1
    digest, newest, plan = survey(ident, path, group)
    records, rows = _from_importlib(group, path)
    if rows is None:
        return records
    if newest > time.time_ns() - RACY_WINDOW_NS:
        _STATS["racy_skips"] += 1
        return records
    _MEMO[ident] = (digest, plan, records)
    text = encode(digest, plan, rows) if chosen(path, plan, rows, group) else None  # a hit would be refused
    if file is not None and writable and text is not None and write_cache(file, text):
        _STATS["cache_writes"] += 1
    return records


def _verified(stored: Stored, ident: str, group: str, path: list[str]) -> _Answer | None:
    """The stored answer, if its key still holds and each record's ``entry_points.txt`` declares it now."""
    digest, plan, rows = stored
    if key(ident, path, plan)[0] != digest:
        return None  # the disk changed: an ordinary miss
    if not chosen(path, plan, rows, group):
        _STATS["rejected"] += 1
        return None
    records = (EntryPointRecord(n, v, group, d, ver, path[i], os.path.join(path[i], c)) for n, v, d, ver, i, c in rows)
    return digest, plan, tuple(records)


def _from_importlib(group: str, path: list[str]) -> tuple[tuple[EntryPointRecord, ...], list[Row] | None]:
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
                if (norm := normalize_name(str(dist.name))) not in seen:  # the first of a name, as importlib_metadata
                    seen.add(norm)
                    found += [ep for ep in dist.entry_points if ep.group == group]
            except Exception as exc:
                where, why = dist.locate_file(""), describe_exception(exc)
                message = "distribution %s at %s has unreadable metadata (%s), so its entry points are skipped"
                logging.getLogger("attnhost").warning(message + "; reinstall or remove it", label, where, why)
                found.append(None)  # not cached: a hit would not repeat this warning, and every start must
    index = {os.path.normpath(entry or "."): i for i, entry in reversed(list(enumerate(path)))}  # the first wins
    records: list[EntryPointRecord] = []
    rows: list[Row] = []
    for ep in filter(None, found):
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
    cacheable = len(rows) == len(found) and _paths() == path  # sys.path changed: the answer is for either
    return tuple(records), rows if cacheable else None


# The cache: its key, its file, and the checks that make a hit trustworthy.
def ignored(message: str) -> None:
    """The one debug line for a cache that is not used (``logging`` is imported only then)."""
    import logging

    logging.getLogger("attnhost").debug("entry-point cache ignored: %s", message)


def identity(group: str, path: list[str]) -> str:
    """Everything but the disk that an answer depends on."""
    try:
        cwd = "" if all(map(os.path.isabs, path)) else os.getcwd()
    except OSError:
        cwd = "?"
    return "\0".join((MAGIC, sys.executable, sys.version, sys.prefix, group, cwd, str(len(path)), *path))


def _hash(data: bytes) -> str:
    return blake2b(data, digest_size=16).hexdigest()


def cache_file(ident: str) -> str | None:
    """The cache file for an :func:`identity`, in ``$XDG_CACHE_HOME/attnhost``, else ``$HOME/.cache/attnhost``;
    only absolute ones, else ``None``: no cache."""
    name = f"entry-points-{_hash(ident.encode('utf-8', 'surrogatepass'))}.txt"
    for base in (os.environ.get("XDG_CACHE_HOME", ""), os.path.join(os.environ.get("HOME", ""), ".cache")):
        if os.path.isabs(base):
            return os.path.join(base, "attnhost", name)
    return None


def _metadata_dirs(entry: str) -> list[str]:
    """The metadata directories of a path entry in listing order, as ``importlib_metadata`` finds them (none in what
    is not a directory; an ``egg-info`` outside a ``*.egg`` too, which it then does not read)."""
    try:
        listing = os.listdir(entry or ".")
    except (OSError, ValueError):
        return []
    lows = "\n".join(listing).lower().split("\n")  # no call per name: a hit lists every distribution
    if len(lows) != len(listing):  # a name with a line break in it, or none at all
        lows = [name.lower() for name in listing]
    return [name for name, low in zip(listing, lows, strict=True) if low.endswith(_SUFFIXES) or low == "egg-info"]


def _stat(path: str, dir_fd: int | None = None) -> os.stat_result | None:
    try:
        return os.stat(path, dir_fd=dir_fd)
    except (OSError, ValueError):
        return None


def key(ident: str, path: list[str], plan: Plan) -> tuple[str, int]:
    """The key's digest as the disk is now, statting what *plan* names, and the newest time among those stats."""
    stats: list[os.stat_result | None] = []
    for entry, names in zip(path, plan, strict=True):
        try:  # names resolved from the open path entry: a hit stats every distribution
            fd = os.open(entry or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, ValueError):  # not a directory (a zip, nothing), so nothing under it either
            stats += [_stat(entry or "."), *[None] * len(names)]
            continue
        try:
            stats += [os.fstat(fd), *[_stat(name, fd) for name in names]]
        finally:
            os.close(fd)
    sigs = [st and (st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in stats]
    newest = max((max(sig[4], sig[5]) for sig in sigs if sig is not None), default=0)
    # marshal version 2 writes no back-references: equal values, equal bytes
    return _hash(marshal.dumps((ident, sigs), 2)), newest


def survey(ident: str, path: list[str], group: str) -> tuple[str, int, Plan]:
    """:func:`key` with the plan it is for, taken before ``importlib_metadata`` reads."""
    plan: Plan = []
    for entry in path:
        names: list[str] = []
        for child in _metadata_dirs(entry):
            found = [child, f"{child}/entry_points.txt"]
            if group in (read_entry_points_text(entry, child) or ""):
                found += [f"{child}/METADATA", f"{child}/PKG-INFO"]
            names += [name for name in found if name == child or _stat(f"{entry or '.'}/{name}") is not None]
        plan.append(tuple(names))
    return (*key(ident, path, plan), plan)


def _check(what: str, st: os.stat_result | None = None) -> None:
    """Raise ``ValueError`` unless *what* is the user's, writable by nobody else, and (without *st*) a directory."""
    if st is None:
        st = os.lstat(what)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{what} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what} is owned by uid {st.st_uid}, not by the current user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise ValueError(f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _read(path: str, limit: int, own: bool = False) -> bytes:
    """At most *limit* bytes of a file, opened and read without blocking (a FIFO reads as empty); if *own*, a regular
    file, not through a symlink and only the user's."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if own else 0))
    try:
        if own:
            st = os.fstat(fd)
            _check(path, st)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                raise ValueError(f"{path} is not a regular file of at most {limit} bytes")
        data = b""
        while chunk := os.read(fd, limit + 1 - len(data)):
            data += chunk
        if len(data) > limit:
            raise ValueError(f"{path} grew beyond {limit} bytes while read")
        return data
    finally:
        os.close(fd)


def read_entry_points_text(entry: str, name: str) -> str | None:
    """``<entry>/<name>/entry_points.txt`` as text (:func:`declared` splits its lines), or ``None``."""
    try:
        return _read(os.path.join(entry, name, "entry_points.txt"), MAX_TEXT_BYTES).decode()
    except (OSError, ValueError):
        return None


def declared(text: str | None, group: str) -> set[tuple[str, str]]:
    """The ``(name, value)`` pairs an ``entry_points.txt`` text declares in *group*, as ``importlib_metadata`` reads."""
    section, found = None, set()
    for line in map(str.strip, (text or "").splitlines()):
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
        elif section == group and line and line[0] != "#" and "=" in line:
            left, _, right = line.partition("=")
            found.add((left.strip(), right.strip()))
    return found


def _dist_keys(entry: str, children: list[str]) -> list[str | None]:
    """The names ``importlib_metadata`` files these metadata directories of *entry* under (its ``Lookup``), normalized;
    None for an ``egg-info`` outside a ``*.egg``, which it does not read. No call per name: every hit runs it."""
    egg = (
        _norm(os.path.basename(entry).rpartition(".")[0].partition("-")[0]) if entry.lower().endswith(".egg") else None
    )
    lows = [child.lower() for child in children]
    stems = [low.rpartition(".")[0].partition("-")[0].replace(".", "_") for low in lows]
    return [egg if low == "egg-info" else _norm(s) if "__" in s else s for low, s in zip(lows, stems, strict=True)]


def _norm(name: str) -> str:
    """``importlib_metadata``'s ``Prepared.normalize`` (runs of ``-_.`` as one ``_``, lower case), without ``re``."""
    name = name.lower().replace("-", "_").replace(".", "_")
    while "__" in name:
        name = name.replace("__", "_")
    return name


def _named(entry: str, child: str, dist: str, dist_key: str) -> bool:
    """Whether the directory's ``Name`` is *dist*: read only when its own name (*dist_key*) does not already say so."""
    if _norm(dist) == dist_key:
        return True
    for meta in ("METADATA", "PKG-INFO"):  # the order importlib_metadata reads them in
        try:
            head = _read(os.path.join(entry, child, meta), MAX_TEXT_BYTES).decode().partition("\n\n")[0]
        except (OSError, ValueError):
            continue
        return dist in (line[5:].strip() for line in head.splitlines() if line.lower().startswith("name:"))
    return False


def chosen(path: list[str], plan: Plan, rows: list[Row], group: str) -> bool:
    """Whether *rows* are what the miss path's rules choose, checked against the disk: the plan names exactly the
    metadata directories of each path entry (so a forged plan cannot leave out one that shadows a row); each row
    comes from the first directory of its normalized name on the path in listing order (as ``importlib_metadata``
    files it), of that ``Name``, whose ``METADATA``/``PKG-INFO`` the plan keys (its ``entry_points.txt`` mentions
    the group); and each such first directory declares exactly its rows."""
    first: dict[str | None, tuple[int, str]] = {}
    keyed: set[tuple[int, str]] = set()  # the directories whose entry_points.txt mentions the group
    for idx in reversed(range(len(plan))):  # an earlier path entry overwrites a later one's: the first wins
        entry, names, found = path[idx], plan[idx], _metadata_dirs(path[idx])
        children = [name for name in names if "/" not in name]
        if len(children) != len(found) or set(children) != set(found):
            ignored(f"its plan does not list the metadata directories of {entry!r}")
            return False
        keyed.update((idx, name.partition("/")[0]) for name in names if name.endswith(("/METADATA", "/PKG-INFO")))
        found.reverse()  # a later directory of a name is overwritten by an earlier one too
        first.update(zip(_dist_keys(entry, found), ((idx, name) for name in found), strict=True))
    firsts = {where: dist_key for dist_key, where in first.items() if where in keyed and dist_key is not None}
    got: dict[tuple[int, str], set[tuple[str, str]]] = {}
    for name, value, dist, _, idx, child in rows:
        got.setdefault((idx, child), set()).add((name, value))
        if (idx, child) not in firsts:
            why = f"is not the first metadata directory of {dist!r} on the path"
            ignored(f"it holds entry point {name!r} = {value!r}, which {path[idx]}/{child} does not declare: it {why}")
            return False
        if not _named(path[idx], child, dist, firsts[idx, child]):
            ignored(f"it holds entry point {name!r} of {dist!r}, which {path[idx]}/{child} does not declare (its Name)")
            return False
    for idx, child in firsts:
        if declared(read_entry_points_text(path[idx], child), group) != got.get((idx, child), set()):
            ignored(f"{path[idx]}/{child} does not declare exactly the entry points the cache holds from it")
            return False
    return True


def encode(digest: str, plan: Plan, rows: list[Row]) -> str | None:
    """Magic, digest, a line per path entry, a line per row, checksum; ``None`` if a field holds a separator."""
    fields = [name for names in plan for name in names] + [f for row in rows for f in (*row[:4], row[5])]
    if any("\t" in f or "\n" in f for f in fields):
        return None
    body = "\n".join([MAGIC, digest, *map("\t".join, plan), *("\t".join((*r[:4], str(r[4]), r[5])) for r in rows)])
    return f"{body}\n{_hash(body.encode('utf-8', 'surrogatepass'))}"


def decode(text: str, n_entries: int) -> Stored:
    """The digest, plan and rows of a cache text; ``ValueError`` if it is not a well-formed one for *n_entries*."""
    body, _, check = text.rpartition("\n")
    lines = body.split("\n")
    if check != _hash(body.encode()) or lines[0] != MAGIC or len(lines) < n_entries + 2:
        raise ValueError("the cache file is not well formed")
    rows = [(n, v, d, ver, int(i), c) for n, v, d, ver, i, c in (line.split("\t") for line in lines[n_entries + 2 :])]
    if any(not 0 <= row[4] < n_entries for row in rows):
        raise ValueError("the cache file names a path entry out of range")
    return lines[1], [tuple(line.split("\t")) if line else () for line in lines[2 : n_entries + 2]], rows


def read_cache(file: str, n_entries: int) -> tuple[Stored | None, bool]:
    """What the cache file holds (:func:`decode`) if it is safe to use, and whether its directory may be written."""
    directory_ok = False
    try:
        _check(os.path.dirname(file))
        directory_ok = True
        return decode(_read(file, MAX_CACHE_BYTES, own=True).decode(), n_entries), True
    except FileNotFoundError:
        return None, True
    except (OSError, ValueError) as exc:  # not ours, writable by others, a symlink, a FIFO, too large, not UTF-8
        ignored(str(exc))
        return None, directory_ok


def write_cache(file: str, text: str) -> bool:
    """Write *text* as *file*, atomically, ``0600`` in a ``0700`` directory; whether it was written."""
    import contextlib  # the miss path: importlib_metadata has imported it already

    directory = os.path.dirname(file)
    tmp = f"{file}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        os.makedirs(os.path.dirname(directory), 0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
        _check(directory)
        with open(tmp, "xb", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(text.encode())
        os.replace(tmp, file)
        return True
    except (OSError, ValueError) as exc:
        ignored(f"cannot write {file}: {exc}")
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
