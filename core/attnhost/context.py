"""The forward context: which runner's backend the current forward runs on.

Each runner enters its own context (a ``ContextVar``: right across threads, asyncio tasks and nesting), never
global args (docs/architecture.md); dispatch, per layer per step, is one ``ContextVar.get`` and one tuple index.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnhost.errors import NoForwardContextError

if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend
    from attnhost.forward_mode import ForwardMode

__all__ = ["ForwardContext", "dispatch_attention_backend", "get_attn_backend"]


@dataclass(frozen=True, slots=True)  # slots, not a NamedTuple: dispatch reads ``names`` faster
class ForwardContext:
    """What one runner's forwards dispatch on: its backend and the backend name per ``int(mode)``."""

    backend: AttentionBackend
    names: tuple[str, ...]

    @contextmanager
    def activate(self) -> Iterator[AttentionBackend]:
        """Make this the current context inside the ``with`` block (each ``with`` its own reset token)."""
        token = _CURRENT.set(self)
        try:
            yield self.backend
        finally:
            _CURRENT.reset(token)


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("attnhost_forward_context", default=None)

_NO_CONTEXT = (
    "no forward context is active: attention was dispatched outside a model runner's forward; "
    "wrap the forward in `with runner.forward_context():`"
)


def get_attn_backend() -> AttentionBackend:
    """The current runner's attention backend (SGLang's ``get_attn_backend``)."""
    context = _CURRENT.get(None)
    if context is None:
        raise NoForwardContextError(_NO_CONTEXT)
    return context.backend


def dispatch_attention_backend(mode: ForwardMode) -> str:
    """The backend name this forward uses, as SGLang's ``dispatch_attn_forward_method`` picks it."""
    context = _CURRENT.get(None)
    if context is None:
        raise NoForwardContextError(_NO_CONTEXT)
    return context.names[mode]
