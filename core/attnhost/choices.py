"""SGLang's registration API (``add_*_attention_backend_choices``) and its read-only lists.

In SGLang these were mutable module-level lists: registering after argument parsing was silently ignored, and
anyone could ``.remove()`` a choice. Here the functions raise ``RegistryFrozenError`` once a ``ServerArgs``
exists, and the "lists" are live read-only views of the registry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn, overload

from attnhost.host import default_host, get_registry
from attnhost.registry import Role

__all__ = ["ATTENTION_BACKEND_CHOICES", "DRAFT_ATTENTION_BACKEND_CHOICES", "BackendChoices"]
__all__ += ["add_attention_backend_choices", "add_draft_attention_backend_choices"]


class BackendChoices(Sequence[str]):
    """A read-only, always-current sequence of backend names of one role."""

    __slots__ = ("_role",)

    def __init__(self, role: Role) -> None:
        self._role = role

    def _names(self) -> tuple[str, ...]:
        return get_registry().names(self._role)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (BackendChoices, list, tuple)):
            return list(self._names()) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(list(self._names()))

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        function = "add_draft_attention_backend_choices" if self._role == "draft" else "add_attention_backend_choices"
        raise TypeError(
            f"backend choices are read-only; register names with attnhost.{function}() or from a plugin entry point"
        )

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = _refuse


ATTENTION_BACKEND_CHOICES = BackendChoices("target")
DRAFT_ATTENTION_BACKEND_CHOICES = BackendChoices("draft")


def add_attention_backend_choices(names: Iterable[str]) -> None:
    """Add backend names (declared only, no implementation) before the first ``ServerArgs``."""
    default_host().add_choices(names, draft=False)


def add_draft_attention_backend_choices(names: Iterable[str]) -> None:
    """Let draft workers use these names; unknown names become declared-only backends."""
    default_host().add_choices(names, draft=True)
