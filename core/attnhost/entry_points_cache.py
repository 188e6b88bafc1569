"""The on-disk entry-point cache: its key, its file, and the checks that make a hit trustworthy.

A leaf module (``os``, ``sys``, ``stat``, ``marshal``, ``_blake2``): a cache hit
runs only this and :mod:`attnhost.entry_points`, never ``importlib.metadata``
nor ``importlib_metadata``. Answers themselves always come from
``importlib_metadata``; this module only decides whether a stored answer still
describes the disk.

The key
-------
One file per (interpreter, group, ``sys.path``): its name hashes
:func:`identity`. The key inside it is a blake2b digest of :func:`identity`
plus ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of, per path entry:

1. the entry itself (a directory's mtime/ctime move whenever a name in it is
   created, removed or renamed: an install, uninstall, upgrade or reinstall;
   a zip file's stat covers everything inside it);
2. for *every* metadata directory in it (a name ending in ``.dist-info`` or
   ``.egg-info``, or ``EGG-INFO``, in any case: a superset of what
   ``importlib_metadata`` looks at): the directory itself (its mtime/ctime
   move when a file in it is created, removed or renamed: an
   ``entry_points.txt`` added or removed, a ``METADATA`` appearing), and its
   ``entry_points.txt`` when it has one (catches an in-place edit, even one
   that keeps inode, size and mtime: the kernel sets ctime on every change);
3. for each metadata directory whose ``entry_points.txt`` mentions the group,
   its ``METADATA``/``PKG-INFO`` (the distribution's name and version are
   part of the answer).

Every stat is taken before the file it vouches for is read, so a concurrent
change can only cause a later miss, never a stale hit. A stat that fails on
the hit path (a file gone) is a miss.

Same-second changes: timestamps are only as fine as the kernel's clock tick.
A scan is not cached while anything in its key changed within
``attnhost.entry_points.RACY_WINDOW_NS`` of now (git's "racily clean" rule):
after that, any change sets a ctime newer than every ctime in the key.

Remaining blind spots, precisely: (a) a filesystem that maintains neither
ctime nor mtime for the files above (some FUSE or network mounts), where a
change also keeps inode and size; (b) the system clock stepped back by more
than the racy window between the cached scan and a change, with the change
landing on exactly the old (device, inode, size, mtime, ctime); (c) an in-place edit
of the *content* of ``METADATA``/``PKG-INFO`` (not its creation, removal or
replacement) of a distribution whose ``entry_points.txt`` does not mention
the group: it changes the answer only if it changes the name
``importlib_metadata`` deduplicates that distribution by, which comes from
``METADATA`` only when the directory's own name carries none (an upper-case
suffix, an empty name part), and that name then shadows or unshadows a
plugin; (d) anything a custom distribution finder on ``sys.meta_path``
finds: with one installed, no cache is used.

The file
--------
Used only if it is a regular file owned by the effective user, not writable by
group or others, in a directory with the same properties, at most
:data:`MAX_CACHE_BYTES`, opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink, a
FIFO or a device is refused without blocking). The directory is created
``0700`` and files ``0600`` whatever the umask, written atomically. Anything
else: the cache is ignored with one debug line on the ``attnhost`` logger. No
``HOME`` and no ``XDG_CACHE_HOME``: no cache.

A hit is bound to the disk beyond the key: every record names the metadata
directory (one path component under its ``sys.path`` entry) whose
``entry_points.txt`` declares it; that file's stat must be part of the key,
and its current text must declare exactly that name and value in the group
(:func:`declares`). A forged record for a module that no installed
distribution declares is never returned.
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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "MAGIC",
    "MAX_CACHE_BYTES",
    "MAX_TEXT_BYTES",
    "Plan",
    "Survey",
    "cache_dir",
    "cache_file",
    "declares",
    "decode",
    "encode",
    "identity",
    "key",
    "read_cache",
    "read_entry_points_text",
    "survey",
    "write_cache",
]

MAGIC = "attnhost-entry-points-cache\t2"
#: A cache file larger than this is not read.
MAX_CACHE_BYTES = 16 << 20
#: An ``entry_points.txt`` larger than this is not read for the key or the check of a hit.
MAX_TEXT_BYTES = 1 << 20

_SUFFIXES = (".dist-info", ".egg-info")
_FIELD_BAD = ("\t", "\n", "\r")
_STAT_DIR_FD = os.stat in os.supports_dir_fd
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_O_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_Sig = tuple[int, int, int, int, int]


def _debug(message: str) -> None:
    """The one debug line for an ignored cache (``logging`` is imported only on this path)."""
    import logging

    logging.getLogger("attnhost").debug("entry-point cache ignored: %s", message)


def cache_dir() -> str | None:
    """``$XDG_CACHE_HOME/attnhost`` (absolute values only, per the XDG spec), else ``$HOME/.cache/attnhost``.

    ``None`` when neither variable gives an absolute directory: no cache rather
    than one relative to the current directory or guessed from the password database.
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.environ.get("HOME", "")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "attnhost")


def identity(group: str, path: Sequence[str]) -> str:
    """Everything except the filesystem state that an answer depends on."""
    parts = [MAGIC, sys.executable, sys.version, str(sys.implementation.cache_tag), sys.prefix, group]
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


def cache_file(ident: str) -> str | None:
    """The cache file for an :func:`identity`, or ``None`` when there is no cache directory."""
    directory = cache_dir()
    return None if directory is None else os.path.join(directory, f"entry-points-{_hash(ident)}.txt")


def _sig(st: os.stat_result) -> _Sig:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _entry_kind(entry: str) -> tuple[str, _Sig | None]:
    """Kind of a path entry (``d`` directory, ``f`` file, ``m`` missing/other) and its signature."""
    try:
        st = os.stat(entry or ".")
    except (OSError, ValueError):
        return "m", None
    if _stat.S_ISDIR(st.st_mode):
        return "d", _sig(st)
    return ("f" if _stat.S_ISREG(st.st_mode) else "m"), _sig(st)


def _digest(material: list[object]) -> str:
    """``marshal`` format 2 is deterministic; it needs to be stable within one interpreter, part of the key."""
    return _blake2b(marshal.dumps(material, 2), digest_size=16).hexdigest()


def _is_metadata_dir(name: str) -> bool:
    low = name.lower()
    return low.endswith(_SUFFIXES) or low == "egg-info"


class Plan:
    """What a hit must stat: per path entry, its kind and the names (relative to it) in the key."""

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[str, tuple[str, ...]]] | None = None) -> None:
        self.entries: list[tuple[str, tuple[str, ...]]] = entries if entries is not None else []


def key(ident: str, path: Sequence[str], plan: Plan) -> str | None:
    """Recompute the key digest following *plan* (the hit path); ``None`` if some stat fails."""
    if len(plan.entries) != len(path):
        return None
    material: list[object] = [ident]
    add = material.append
    stat = os.stat
    for (kind, targets), entry in zip(plan.entries, path, strict=True):
        now_kind, sig = _entry_kind(entry)
        add((now_kind, sig))
        if kind != "d" or not targets:
            add(())
            continue
        if now_kind != "d":
            return None
        fd: int | None = None
        prefix = entry + os.sep if entry else ""
        if _STAT_DIR_FD:
            try:
                fd = os.open(entry or ".", _O_DIR)
            except OSError:
                return None
            prefix = ""
        try:
            sigs = [stat(prefix + t, dir_fd=fd) for t in targets]
        except (OSError, ValueError):
            return None
        finally:
            if fd is not None:
                os.close(fd)
        add(tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in sigs))
    return _digest(material)


def _read_bounded(path: str, dir_fd: int | None, limit: int, flags: int = _O_READ) -> bytes | None:
    """A regular file's bytes (at most *limit*), opened without blocking; ``None`` otherwise."""
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                return None
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_entry_points_text(entry: str, name: str) -> str | None:
    """``<entry>/<name>/entry_points.txt`` as text, if *name* is one metadata directory name and the file is sane."""
    if not _is_metadata_dir(name) or os.sep in name or (os.altsep and os.altsep in name):
        return None
    data = _read_bounded(os.path.join(entry, name, "entry_points.txt"), None, MAX_TEXT_BYTES)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def declares(text: str, group: str, name: str, value: str) -> bool:
    """Whether an ``entry_points.txt`` text declares ``name = value`` in section *group*.

    Read the way ``importlib_metadata`` reads it (stripped lines, ``#``
    comments, ``[section]`` lines, a pair split at the first ``=``). Only a
    check of a stored answer: should the two ever disagree, the result is a
    cache miss, and ``importlib_metadata`` answers.
    """
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] == "#":
            continue
        if line[0] == "[" and line[-1] == "]":
            section = line.strip("[]")
        elif section == group:
            left, eq, right = line.partition("=")
            if eq and left.strip() == name and right.strip() == value:
                return True
    return False


class Survey:
    """What a miss saw before ``importlib_metadata`` read the disk: the plan, the key, the declaring texts."""

    __slots__ = ("cacheable", "digest", "newest", "plan", "texts")

    def __init__(self) -> None:
        self.plan = Plan()
        self.digest = ""
        self.newest = 0
        self.cacheable = True
        #: ``(entry index, metadata dir) -> entry_points.txt text`` for those mentioning the group.
        self.texts: dict[tuple[int, str], str] = {}


def survey(ident: str, path: Sequence[str], group: str) -> Survey:
    """Stat (and list) everything the key covers, in the layout :func:`key` recomputes."""
    result = Survey()
    material: list[object] = [ident]
    newest = 0
    for idx, entry in enumerate(path):
        kind, sig = _entry_kind(entry)
        material.append((kind, sig))
        if sig is not None:
            newest = max(newest, sig[3], sig[4])
        targets: list[str] = []
        sigs: list[_Sig] = []
        if kind == "d":
            fd: int | None = None
            prefix = entry + os.sep if entry else ""
            try:
                if _STAT_DIR_FD:
                    fd = os.open(entry or ".", _O_DIR)
                    prefix = ""
                children = os.listdir(fd if fd is not None else (entry or "."))
            except (OSError, ValueError):
                result.cacheable = False
                children = []
            try:
                for child in children:
                    if not _is_metadata_dir(child):
                        continue
                    if any(bad in child for bad in _FIELD_BAD):
                        result.cacheable = False  # cannot be written down unambiguously
                        continue
                    found = _child_targets(prefix, child, fd, group, targets, sigs)
                    if found is None:
                        result.cacheable = False  # vanished while we looked: answer, but do not cache
                    elif found:
                        result.texts[(idx, child)] = found
            finally:
                if fd is not None:
                    os.close(fd)
        for s in sigs:
            newest = max(newest, s[3], s[4])
        material.append(tuple(sigs) if kind == "d" and targets else ())
        result.plan.entries.append((kind, tuple(targets)))
    result.digest = _digest(material)
    result.newest = newest
    return result


def _stat_at(name: str, fd: int | None) -> _Sig | None:
    try:
        return _sig(os.stat(name, dir_fd=fd))
    except (OSError, ValueError):
        return None


def _child_targets(
    prefix: str, child: str, fd: int | None, group: str, targets: list[str], sigs: list[_Sig]
) -> str | None:
    """Append one metadata directory's names and stats to the key.

    Returns its ``entry_points.txt`` text when that mentions *group*, ``""``
    when it does not (or there is none), ``None`` when the directory vanished.
    """
    sig = _stat_at(prefix + child, fd)
    if sig is None:
        return None
    targets.append(child)
    sigs.append(sig)
    ep = f"{child}/entry_points.txt"
    sig = _stat_at(prefix + ep, fd)
    if sig is None:
        return ""
    targets.append(ep)
    sigs.append(sig)
    data = _read_bounded(prefix + ep, fd, MAX_TEXT_BYTES)
    if data is None or group.encode("utf-8", "surrogatepass") not in data:
        return ""
    try:
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
    except UnicodeDecodeError:
        return ""
    for extra in (f"{child}/METADATA", f"{child}/PKG-INFO"):
        extra_sig = _stat_at(prefix + extra, fd)
        if extra_sig is not None:
            targets.append(extra)
            sigs.append(extra_sig)
    return text


# --------------------------------------------------------------------------- the file

Row = tuple[str, str, str, str, int, str]
"""``(name, value, distribution, version, path entry index, metadata dir)``."""


def encode(digest: str, plan: Plan, rows: Sequence[Row]) -> str | None:
    """Tab-separated text; ``None`` if a field cannot be stored unambiguously (then it is not cached)."""
    lines = [MAGIC, "K\t" + digest]
    for kind, targets in plan.entries:
        lines.append("\t".join(["P", kind, *targets]))
    for name, value, dist, version, idx, child in rows:
        fields = [name, value, dist, version, child]
        if any(bad in f for f in fields for bad in _FIELD_BAD):
            return None
        lines.append("\t".join(["R", name, value, dist, version, str(idx), child]))
    body = "\n".join(lines)
    return f"{body}\nS\t{_hash(body)}\nE\n"


def decode(text: str, n_entries: int) -> tuple[str, Plan, list[Row]] | None:
    """The digest, plan and rows of a cache text, or ``None`` if it is not a well-formed one for *n_entries*."""
    if not text.startswith(MAGIC + "\nK\t") or not text.endswith("\nE\n"):
        return None
    body, sep, checksum = text[:-3].rpartition("\nS\t")
    if not sep or checksum != _hash(body):
        return None
    lines = body.split("\n")
    digest = lines[1][2:]
    plan = Plan()
    rows: list[Row] = []
    for line in lines[2:]:
        fields = line.split("\t")
        if fields[0] == "P" and len(fields) >= 2 and fields[1] in ("d", "f", "m"):
            plan.entries.append((fields[1], tuple(fields[2:])))
        elif fields[0] == "R" and len(fields) == 7 and fields[5].isdigit():
            idx = int(fields[5])
            if idx >= n_entries:
                return None
            rows.append((fields[1], fields[2], fields[3], fields[4], idx, fields[6]))
        else:
            return None
    if len(plan.entries) != n_entries or len(digest) != 32:
        return None
    return digest, plan, rows


def _insecure(st: os.stat_result, what: str) -> str | None:
    """Why *st* may not be trusted, or ``None``."""
    euid = os.geteuid() if hasattr(os, "geteuid") else None
    if euid is not None and st.st_uid != euid:
        return f"{what} is owned by uid {st.st_uid}, not by the current user (uid {euid})"
    if st.st_mode & 0o022:
        return f"{what} is writable by group or others (mode {_stat.S_IMODE(st.st_mode):o})"
    return None


def _check_dir(directory: str) -> str | None:
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"cannot stat the cache directory {directory}: {exc.strerror}"
    if not _stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    problem = _insecure(st, f"the cache directory {directory}")
    return problem


def read_cache(file: str) -> tuple[str | None, bool]:
    """The cache file's text if it is safe to use (``None`` otherwise, with one debug line unless it is
    absent), and whether its directory may be written to."""
    problem = _check_dir(os.path.dirname(file))
    if problem == "missing":
        return None, True
    if problem is not None:
        _debug(problem)
        return None, False
    try:
        fd = os.open(file, _O_READ | _O_NOFOLLOW)
    except FileNotFoundError:
        return None, True
    except OSError as exc:
        _debug(f"cannot open {file} without following links or blocking: {exc.strerror}")
        return None, True
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            problem = f"{file} is not a regular file"
        elif st.st_size > MAX_CACHE_BYTES:
            problem = f"{file} is larger than {MAX_CACHE_BYTES} bytes"
        else:
            problem = _insecure(st, file)
        if problem is None:
            data = b""
            while len(data) <= MAX_CACHE_BYTES:
                chunk = os.read(fd, MAX_CACHE_BYTES + 1 - len(data))
                if not chunk:
                    break
                data += chunk
            if len(data) > MAX_CACHE_BYTES:
                problem = f"{file} grew beyond {MAX_CACHE_BYTES} bytes while read"
            else:
                try:
                    return data.decode("utf-8"), True
                except UnicodeDecodeError:
                    problem = f"{file} is not UTF-8"
    except OSError as exc:
        problem = f"cannot read {file}: {exc.strerror}"
    finally:
        os.close(fd)
    _debug(problem)
    return None, True


def _ensure_dir(directory: str) -> bool:
    problem = _check_dir(directory)
    if problem == "missing":
        try:
            parent = os.path.dirname(directory)
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o700, exist_ok=True)
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        except OSError as exc:
            _debug(f"cannot create the cache directory {directory}: {exc.strerror}")
            return False
        problem = _check_dir(directory)
    if problem is not None:
        _debug(problem)
        return False
    return True


def write_cache(file: str, text: str) -> bool:
    """Write *text* atomically as *file* (``0600`` in a ``0700`` directory); whether it was written."""
    directory = os.path.dirname(file)
    if not _ensure_dir(directory):
        return False
    tmp = f"{file}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _CLOEXEC, 0o600)
    except OSError as exc:
        _debug(f"cannot write in {directory}: {exc.strerror}")
        return False
    try:
        try:
            os.fchmod(fd, 0o600)
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, file)
        return True
    except (OSError, UnicodeEncodeError) as exc:
        _debug(f"cannot write {file}: {getattr(exc, 'strerror', None) or exc}")
        try:  # noqa: SIM105 - contextlib.suppress would cost an import on this path
            os.unlink(tmp)
        except OSError:
            pass
        return False
