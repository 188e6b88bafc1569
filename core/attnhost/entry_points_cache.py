"""The on-disk entry-point cache: its key, its file, and the checks that make a hit trustworthy.

A leaf module: a hit imports neither ``importlib.metadata`` nor ``importlib_metadata``. The key digests
:func:`identity` and ``(mode, dev, ino, size, mtime_ns, ctime_ns)`` of each path entry, of every metadata
directory in it (moved when a file is added or removed), of its ``entry_points.txt`` and, if that mentions the
group, its ``METADATA`` / ``PKG-INFO``, all statted before ``importlib_metadata`` reads. The kernel sets ctime to
now on every change, so an in-place edit is seen; and as nothing younger than ``RACY_WINDOW_NS`` is cached, nor
is a change racing the survey. Blind spots: (a) a filesystem keeping neither ctime nor mtime; (b) the clock
stepped back by more than the racy window; (c) an in-place edit of the ``METADATA`` of a distribution whose
``entry_points.txt`` does not mention the group and whose directory name carries no name, renaming it to shadow
a plugin; (d) a custom finder on ``sys.meta_path`` (then no cache is used). The file is used only if a regular
file of at most :data:`MAX_CACHE_BYTES`, the user's and not writable by group or others, in a directory alike,
opened with ``O_NOFOLLOW | O_NONBLOCK``; directory ``0700``, files ``0600`` whatever the umask; else ignored,
with one debug line.
"""

from __future__ import annotations

import marshal
import os
import stat
import sys

try:
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - CPython ships _blake2
    from hashlib import blake2b

__all__ = ["MAX_CACHE_BYTES", "Plan", "Row", "cache_dir", "cache_file", "declares", "decode", "encode", "identity"]
__all__ += ["Stored", "ignored", "key", "read_cache", "read_entry_points_text", "survey", "write_cache"]

MAGIC = "attnhost-entry-points-cache\t2"
MAX_CACHE_BYTES = 16 << 20
MAX_TEXT_BYTES = 1 << 20  # an entry_points.txt larger than this is not read (for the key or a hit's check)

Plan = list[tuple[str, ...]]  # per path entry, the names under it (child or child/file) in the key
Row = tuple[str, str, str, str, int, str]  # name, value, distribution, version, path entry index, metadata dir
Stored = tuple[str, Plan, list[Row]]  # what a cache file holds: the key's digest, the plan, the records


def ignored(message: str) -> None:
    """The one debug line for a cache that is not used (``logging`` is imported only then)."""
    import logging

    logging.getLogger("attnhost").debug("entry-point cache ignored: %s", message)


def cache_dir() -> str | None:
    """``$XDG_CACHE_HOME/attnhost``, else ``$HOME/.cache/attnhost``; only absolute ones, else ``None``: no cache."""
    for base in (os.environ.get("XDG_CACHE_HOME", ""), os.path.join(os.environ.get("HOME", ""), ".cache")):
        if os.path.isabs(base):
            return os.path.join(base, "attnhost")
    return None


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
    """The cache file for an :func:`identity`, or ``None`` when there is no cache directory."""
    directory = cache_dir()
    name = f"entry-points-{_hash(ident.encode('utf-8', 'surrogatepass'))}.txt"
    return None if directory is None else os.path.join(directory, name)


def _sig(path: str) -> tuple[int, int, int, int, int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _is_metadata_dir(name: str) -> bool:
    low = name.lower()
    return low.endswith((".dist-info", ".egg-info")) or low == "egg-info"


def key(ident: str, path: list[str], plan: Plan) -> tuple[str, int]:
    """The key's digest as the disk is now, statting what *plan* (one tuple per path entry) names, and the newest
    time seen among those stats."""
    sigs = [
        _sig(f"{entry or '.'}/{name}" if name else entry or ".")
        for entry, names in zip(path, plan, strict=True)
        for name in ("", *names)
    ]
    newest = max((max(sig[4], sig[5]) for sig in sigs if sig is not None), default=0)
    # marshal version 2 writes no back-references: equal values, equal bytes
    return _hash(marshal.dumps((ident, sigs), 2)), newest


def survey(ident: str, path: list[str], group: str) -> tuple[str, int, Plan]:
    """:func:`key` with the plan it is for, taken before ``importlib_metadata`` reads."""
    plan: Plan = []
    for entry in path:
        try:
            children = [child for child in os.listdir(entry or ".") if _is_metadata_dir(child)]
        except (OSError, ValueError):  # not a directory: importlib_metadata finds none there either
            children = []
        names: list[str] = []
        for child in children:
            found = [child, f"{child}/entry_points.txt"]
            if group in (read_entry_points_text(entry, child) or ""):
                found += [f"{child}/METADATA", f"{child}/PKG-INFO"]
            names += [name for name in found if name == child or _sig(f"{entry or '.'}/{name}") is not None]
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
    """A regular file's bytes, opened without blocking; if *own*, not through a symlink and only the user's."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if own else 0))
    try:
        st = os.fstat(fd)
        if own:
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
    """``<entry>/<name>/entry_points.txt`` as text mode reads it, if *name* is one metadata directory's name."""
    if not _is_metadata_dir(name) or os.sep in name or (os.altsep or os.sep) in name:
        return None
    try:
        data = _read(os.path.join(entry, name, "entry_points.txt"), MAX_TEXT_BYTES)
        return data.decode().replace("\r\n", "\n").replace("\r", "\n")
    except (OSError, ValueError):
        return None


def declares(text: str | None, group: str, name: str, value: str) -> bool:
    """Whether an ``entry_points.txt`` text declares ``name = value`` in *group*, as ``importlib_metadata`` reads it."""
    section = None
    for line in map(str.strip, (text or "").splitlines()):
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
        elif section == group and line and line[0] != "#":
            left, eq, right = line.partition("=")
            if eq and left.strip() == name and right.strip() == value:
                return True
    return False


def encode(digest: str, plan: Plan, rows: list[Row]) -> str | None:
    """Magic, digest, a line per path entry, a line per row, checksum; ``None`` if a field holds a separator."""
    fields = [name for names in plan for name in names] + [f for row in rows for f in (*row[:4], row[5])]
    if any("\t" in f or "\n" in f for f in fields):
        return None
    lines = [MAGIC, digest, *map("\t".join, plan), *("\t".join((*r[:4], str(r[4]), r[5])) for r in rows)]
    body = "\n".join(lines)
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
