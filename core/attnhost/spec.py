"""``BackendSpec``: what a plugin says about one attention backend, pure data plus a *lazy* factory reference, so
discovery and the CLI can list, validate and explain every backend without paying for (or crashing on) its kernels."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union, cast

from attnhost.errors import safe_repr

if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend, AttentionRunner

__all__ = ["MAX_NAME_LENGTH", "BackendFactory", "BackendSpec", "check_backend_name"]

MAX_NAME_LENGTH = 64
"""The longest backend name or alias: SGLang's longest is under 30, and a name must fit a table and a flag."""

BackendFactory = Callable[["AttentionRunner"], "AttentionBackend"]
"""Called once per model runner as ``factory(runner)``; returns that runner's own backend."""


_BACKEND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)


def check_backend_name(name: object, what: str = "backend name") -> str:
    """Return ``name`` if it can be typed on a command line and printed in a table (names become argparse
    choices and JSON keys), else raise."""
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a string, not {type(name).__name__} {safe_repr(name)}")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"invalid {what} {safe_repr(name)}: {len(name)} characters, more than the {MAX_NAME_LENGTH} allowed"
        )
    if not _BACKEND_NAME.fullmatch(name):
        raise ValueError(
            f"invalid {what} {name!r}: use letters, digits, '_', '-' or '.', starting with a letter or digit"
        )
    return name


def _as_tuple(value: str | Iterable[str] | None, what: str, spec_name: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value or ())
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"backend {spec_name!r}: {what} must be strings, got {item!r}")
    return items


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One attention backend as a plugin declares it. ``factory``: ``"module:attr"`` (imported only by :meth:`load`), a
    callable, or ``None`` for a *declared-only* name (a known choice whose implementation is not installed, reported as
    such instead of faked). ``platforms`` empty: any. ``requires``: the Python modules the kernels need;
    ``provided_by``: the pip distribution that brings them, named in every "unavailable" error."""

    name: str
    factory: Union[str, BackendFactory, None] = None  # noqa: UP007 - a runtime alias with a string part
    aliases: tuple[str, ...] = ()
    platforms: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    provided_by: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        check_backend_name(self.name)
        aliases = _as_tuple(self.aliases, "aliases", self.name)
        for alias in aliases:
            check_backend_name(alias, f"alias of backend {self.name!r}")
        platforms = tuple(p.lower() for p in _as_tuple(self.platforms, "platforms", self.name))
        requires = _as_tuple(self.requires, "required modules", self.name)
        for module in requires:
            if not _MODULE_NAME.fullmatch(module):
                raise ValueError(f"backend {self.name!r}: {module!r} is not a Python module name")
        for field_name, value in (("aliases", aliases), ("platforms", platforms), ("requires", requires)):
            object.__setattr__(self, field_name, value)
        if isinstance(self.factory, str):
            if not _MODULE_NAME.fullmatch(self.factory.partition(":")[0].strip()):
                raise ValueError(f"backend {self.name!r}: factory {self.factory!r} is not a 'module:attr' reference")
        elif self.factory is not None and not callable(self.factory):
            raise ValueError(
                f"backend {self.name!r}: factory must be a 'module:attr' string, a callable or None, "
                f"not {type(self.factory).__name__}"
            )
        if not isinstance(self.description, str):
            raise ValueError(f"backend {self.name!r}: description must be a string")
        if self.provided_by is not None and not isinstance(self.provided_by, str):
            raise ValueError(f"backend {self.name!r}: provided_by must be a distribution name")

    @property
    def implemented(self) -> bool:
        return self.factory is not None

    @property
    def factory_module(self) -> str | None:
        """The module :meth:`load` would import, without importing it."""
        if isinstance(self.factory, str):
            return self.factory.partition(":")[0].strip()
        return getattr(self.factory, "__module__", None)

    def load(self) -> BackendFactory:
        """Import (if needed) and return the factory; the first and only place that imports it."""
        if self.factory is None:
            raise LookupError(f"backend {self.name!r} is declared only: it has no factory to load")
        if isinstance(self.factory, str):  # "package.module:attr.sub", resolved the way entry points are
            module_name, _, attrs = self.factory.partition(":")
            obj: Any = importlib.import_module(module_name.strip())
            for attr in filter(None, attrs.strip().split(".")):
                obj = getattr(obj, attr)
            if not callable(obj):
                raise TypeError(f"factory {self.factory!r} of backend {self.name!r} is not callable")
            return cast("BackendFactory", obj)
        return self.factory
