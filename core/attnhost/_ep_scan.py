"""Reading the environment: what :func:`attnhost.entry_points.scan` finds when the cache cannot answer.

Replicates ``importlib.metadata``'s lookup (path-entry listing order,
shadowing, ``entry_points.txt`` and ``METADATA`` parsing) with
``os.listdir``/``os.stat``/``open`` alone, because importing
``importlib.metadata`` is the cost this package exists to avoid; the exact
semantics are in :mod:`attnhost.entry_points`. A keyed scan also records what
the cache must stat later (:class:`attnhost._ep_cache._Plan`), stat'ing each
file before reading it. ``importlib.metadata`` is imported only for what we
cannot read ourselves: zip files on the path, custom distribution finders.
"""

from __future__ import annotations

import os

from attnhost._ep_cache import _STATS, _digest, _edited_in_place, _entry_kind, _extra_item, _Plan, _Scope, _Sig, _sig
from attnhost._ep_record import EntryPointRecord, _split_value, normalize_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

_SUFFIXES = (".dist-info", ".egg-info")


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
