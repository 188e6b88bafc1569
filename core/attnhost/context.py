"""The forward context: which runner's backend the current forward runs on.

SGLang #28559's bug was a draft runner writing its backend into global args,
so the target dispatched to the draft's kernel. Here model code asks the
*current* context, which each runner enters for its own forwards; a
``ContextVar`` keeps that correct across threads, asyncio tasks and nested
runners.

``dispatch_attention_backend`` runs per layer per step, so everything it needs
is precomputed into a tuple indexed by the forward mode when the context is
entered: one ``ContextVar.get`` and one tuple index per call, no allocation.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING

from attnhost.errors import NoForwardContextError
from attnhost.forward_mode import ForwardMode, uses_decode_backend

if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend

__all__ = [
    "ForwardContext",
    "dispatch_attention_backend",
    "dispatch_table",
    "get_attn_backend",
]


def dispatch_table(prefill: str, decode: str, speculative_attention_mode: str) -> tuple[str, ...]:
    """The backend name for every forward mode, indexed by ``int(mode)``."""
    return tuple(decode if uses_decode_backend(mode, speculative_attention_mode) else prefill for mode in ForwardMode)


class ForwardContext:
    """What one runner's forwards dispatch on: its backend and the per-mode backend names."""

    __slots__ = ("backend", "names")

    def __init__(self, backend: AttentionBackend, names: tuple[str, ...]) -> None:
        self.backend = backend
        self.names = names

    def activate(self) -> _Activation:
        """A context manager making this the current context.

        A fresh one per ``with``, so concurrent threads never share a reset token.
        """
        return _Activation(self)


class _Activation:
    __slots__ = ("_context", "_token")

    def __init__(self, context: ForwardContext) -> None:
        self._context = context
        self._token: Token[ForwardContext | None] | None = None

    def __enter__(self) -> AttentionBackend:
        if self._token is not None:
            raise RuntimeError("a forward context activation cannot be entered twice; call forward_context() again")
        self._token = _CURRENT.set(self._context)
        return self._context.backend

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._token is not None
        _CURRENT.reset(self._token)


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
    """The backend name this forward uses, as SGLang's ``dispatch_attn_forward_method`` picks it.

    Hot path: called per layer per step. One context lookup, one tuple index.
    """
    context = _CURRENT.get(None)
    if context is None:
        raise NoForwardContextError(_NO_CONTEXT)
    return context.names[mode]
