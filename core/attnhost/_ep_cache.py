"""The on-disk cache behind :func:`attnhost.entry_points.scan`: its key, its file, and why the key is correct.

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
:data:`attnhost.entry_points.RACY_WINDOW_NS` (3 s) of now, or in the future, is
returned but *not cached*. ``ctime`` is set by the kernel to the real time of every change
(content, rename, chmod, ``utime`` itself) and cannot be forged from user
space, so anything modified after a cache was written carries a ctime newer
than every ctime in that cache's key: the key must change. This holds even for
writers that restore old mtimes (``cp -p``, ``tar``, ``rsync -t``). The price:
a freshly installed environment is parsed normally (a few ms) for 3 s, then
cached. Tests shorten the window by setting ``attnhost.entry_points.RACY_WINDOW_NS``.

Order matters for correctness and is kept: every stat happens *before* the
listing or file it vouches for is read, so a concurrent change can only cause
a spurious miss, never a stale hit.

The file is tab-separated text: a magic/schema line, the key digest, the plan
(one line per path entry: kind, stat flags, names; one per metadata file read),
one line per record, and a blake2b checksum of all of it (so a torn or
bit-flipped file is a miss, not wrong records). A corrupt, truncated,
wrong-schema or unreadable cache file, or an unwritable cache directory, is
ignored without a warning and rewritten when possible. Files are written
atomically (unique temporary file + ``os.replace``).

The key is built in two places that must agree: :class:`attnhost._ep_scan._Builder`
during a full scan, and :func:`_key_for_plan` on every cached call.
"""

from __future__ import annotations

import marshal
import os
import stat as _stat
import sys

try:
    from _blake2 import blake2b as _blake2b
except ImportError:  # pragma: no cover - CPython always ships _blake2
    from hashlib import blake2b as _blake2b

from attnhost._ep_record import EntryPointRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

_MAGIC = "attnhost-entry-points-cache\t1"
_FIELD_BAD = ("\t", "\n", "\r")
_STAT_DIR_FD = os.stat in os.supports_dir_fd
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)

#: Counters behind :func:`attnhost.entry_points.scan_stats`, kept here because they exist to show what the
#: cache did and this module is loaded by every scan (:mod:`attnhost._ep_scan` is not, on a hit).
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

_Sig = tuple[int, ...]


def _sig(path: str, dir_fd: int | None = None) -> _Sig:
    """``(st_ino, st_size, st_mtime_ns, st_ctime_ns)``, or ``()`` if the stat failed."""
    try:
        st = os.stat(path, dir_fd=dir_fd)
    except (OSError, ValueError):
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


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
