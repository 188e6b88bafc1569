"""The entry-point record and the syntax of its value, shared by the scan, the cache and callers.

A leaf module (it imports only ``sys``) so that :mod:`attnhost._ep_scan` and
:mod:`attnhost._ep_cache` can build records without importing
:mod:`attnhost.entry_points`, which imports them. Import the names from
:mod:`attnhost.entry_points`, their public home.
"""

from __future__ import annotations

import sys

__all__ = ["EntryPointRecord", "normalize_name"]


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

    __module__ = "attnhost.entry_points"  # its public home: pickles and reprs name it
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
