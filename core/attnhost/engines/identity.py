"""Who an attnhost backend is inside an engine: one name in every message, one way for every plugin call to fail.

Both bridges hand an operator the same sentences about a backend, so both build them here: where it comes from
(``attnhost backend 'x' (plugin ...), SGLang --attention-backend 'x'``), what it does not support and the way out,
what it raised and whom to tell. Loading its factory fails with the sentence attnhost's own runner says (``... could
not be loaded: <cause>; fix or reinstall <distribution>, or choose another <flag>``), whichever host loads it.

A bridge also asks, before any runner exists, what an exported backend declares (``mla`` picks DeepSeek's dispatch
in SGLang and a second enum member in vLLM), and says each registration line once per process although it
re-syncs its plan many times: :func:`declared_capabilities`, :func:`declares_mla` and :class:`LogOnce`.

This module imports neither an engine nor torch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from attnhost.backend import BackendCapabilities, capabilities_of
from attnhost.building import build_backend
from attnhost.errors import (
    BackendFailedError,
    BackendUnavailableError,
    UnsupportedFeatureError,
    backend_failed,
    describe_exception,
)

if TYPE_CHECKING:
    from attnhost.backend import AttentionBackend, AttentionRunner
    from attnhost.engines.export import ExportedBackend
    from attnhost.forward_mode import ForwardMode

__all__ = ["BackendIdentity", "LogOnce", "declared_capabilities", "declares_mla"]


@dataclass(frozen=True, slots=True)
class BackendIdentity:
    """Which attnhost backend an engine name serves, its loaded factory, and how every message names it."""

    engine_name: str
    """The name the engine's flag takes."""
    attnhost_name: str
    origin: str
    """Its plugin and distribution, as every message names a plugin (``plugin 'x' (distribution y 1.0)``)."""
    factory: Any
    capabilities: BackendCapabilities
    engine: str
    """The engine as messages name it: ``SGLang``, ``vLLM``."""
    flag: str = "--attention-backend"
    """The engine flag that chose the backend, which every way out names (a draft's may be its own)."""
    distribution: str | None = None
    """Its plugin's distribution, to reinstall; ``None`` for a plugin registered in-process."""

    @classmethod
    def of(cls, backend: ExportedBackend, engine_name: str, engine: str, **named: Any) -> Self:
        """The identity of an exported backend under ``engine_name``, its factory loaded and its capabilities read;
        either failing is a ``BackendUnavailableError`` in the sentence attnhost's runner says too. ``named``: the
        further fields (``flag``, and a subclass's own)."""
        entry = backend.entry
        unloaded = cls(
            engine_name,
            backend.name,
            entry.label,
            None,
            BackendCapabilities(),
            engine,
            **{"distribution": entry.distribution, **named},
        )
        try:
            factory = entry.spec.load()
        except (Exception, SystemExit) as exc:
            raise BackendUnavailableError(
                f"{unloaded.where} could not be loaded: {describe_exception(exc)}; {unloaded.way_out}"
            ) from exc
        try:
            capabilities = capabilities_of(factory)
        except TypeError as exc:
            raise BackendUnavailableError(
                f"{unloaded.where} declares no usable capabilities: {exc}; {unloaded.way_out}"
            ) from exc
        return dataclasses.replace(unloaded, factory=factory, capabilities=capabilities)

    @property
    def selected_as(self) -> str:
        """How the operator selected it: the engine, its flag and the name as the flag took it."""
        return f"{self.engine} {self.flag} {self.engine_name!r}"

    @property
    def where(self) -> str:
        """What every message about the backend starts with."""
        return f"attnhost backend {self.attnhost_name!r} ({self.origin}), {self.selected_as}"

    @property
    def way_out(self) -> str:
        """The way out when its plugin is broken (its factory cannot be loaded, or raises when called)."""
        fix = f"fix or reinstall {self.distribution}" if self.distribution else "fix the plugin"
        return f"{fix}, or choose another {self.flag}"

    @property
    def engine_bug(self) -> str:
        """The way out of a batch no engine should send: the engine's maintainers need the command."""
        return f"report this to {self.engine}'s maintainers with the command that produced it"

    def refuse(self, feature: str, way_out: str | None = None) -> UnsupportedFeatureError:
        """A feature the backend (or the attnhost contract) does not support, named with the way out."""
        return UnsupportedFeatureError(
            f"{self.where} does not support {feature}; {way_out or 'choose another ' + self.flag}"
        )

    def failed(self, method: str, mode: ForwardMode, layer_id: int | None, exc: BaseException) -> BackendFailedError:
        """The backend raised in ``method``: one line naming it, its plugin, the batch and the cause."""
        return backend_failed(self.where, self.origin, method, mode.name, layer_id, exc)

    def build(self, runner: AttentionRunner) -> AttentionBackend:
        """A new instance of the backend for ``runner``, its factory's failures named as this backend's."""
        return build_backend(self.factory, runner, where=self.where, way_out=self.way_out, owner=self.origin)


def declared_capabilities(backend: ExportedBackend) -> BackendCapabilities | None:
    """What an exported backend declares, or ``None`` when its factory cannot be loaded or read (its runner says
    why, with :meth:`BackendIdentity.of`'s sentence, when the engine builds it)."""
    try:
        return capabilities_of(backend.entry.spec.load())
    except Exception:
        return None


def declares_mla(backend: ExportedBackend) -> bool:
    """Whether an exported backend declares ``mla``; an unloadable one cannot run an MLA model."""
    capabilities = declared_capabilities(backend)
    return capabilities is not None and capabilities.mla


class LogOnce:
    """A bridge's logger that says each message once per process: a bridge re-syncs its registrations on every
    resolution, and an operator needs each line once."""

    __slots__ = ("_logger", "_said")

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._said: set[str] = set()

    def __call__(self, level: int, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self._logger.log(level, "%s", message)
