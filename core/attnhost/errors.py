"""Every exception attnhost raises, and the helpers that turn other people's objects into one line of text.

Every message is one sentence that names the culprit (plugin, distribution or backend) and says how to get out:
the CLI prints ``str(exc)`` as-is. The text helpers live here, at the bottom, so that any layer can format a
plugin's exception without importing the plugin loader.
"""

from __future__ import annotations

import logging

__all__ = ["AttnhostError", "BackendFailedError", "BackendUnavailableError", "InvalidBatchError", "InvalidPluginError"]
__all__ += ["KVPoolFullError", "NoForwardContextError"]
__all__ += ["PlatformError", "PluginLoadError", "PluginLoadInterrupted", "PluginProblem", "RankCheckError"]
__all__ += ["RankMismatchError", "RegistryFrozenError", "UnknownBackendError", "UnsupportedFeatureError"]
__all__ += [
    "backend_failed",
    "describe_exception",
    "one_line",
    "plugin_label",
    "printable",
    "printable_record",
    "safe_repr",
]


class AttnhostError(Exception):
    """Base class of every error attnhost raises on purpose."""


class RegistryFrozenError(AttnhostError):
    """A backend or plugin was registered after the first ``ServerArgs`` was built: SGLang silently ignored such
    late registrations, but choices that argument parsing has validated against must not change underneath it."""


class UnknownBackendError(AttnhostError, ValueError):
    """A backend name that no installed plugin registered."""


class BackendUnavailableError(AttnhostError, RuntimeError):
    """A known backend that cannot be built here (declared only, wrong platform, missing module)."""


class UnsupportedFeatureError(BackendUnavailableError, NotImplementedError):
    """An engine asked an attnhost backend for what the attnhost contract cannot express (MLA, sliding windows)."""


class BackendFailedError(AttnhostError, RuntimeError):
    """An attnhost backend raised while an engine ran it (planning a batch or a layer's forward). Engines print
    their own long tracebacks, which end in the plugin's bare exception; this one sentence names the backend, its
    plugin and distribution, the forward mode and the layer, with the plugin's exception chained as the cause."""


class InvalidBatchError(AttnhostError, ValueError):
    """An engine handed a backend a batch that does not add up (a write slot outside the KV cache or given twice,
    a length beyond the request table, a mask of the wrong type): refused before anything is read or written,
    because a kernel would read or write outside its buffers or compute a silently wrong number."""


class PlatformError(AttnhostError, ValueError):
    """An unknown platform name (from ``ATTNHOST_PLATFORM`` or ``--platform``)."""


class PluginLoadError(AttnhostError, RuntimeError):
    """One or more plugins failed to load while ``ATTNHOST_STRICT=1`` is set."""


class PluginLoadInterrupted(KeyboardInterrupt):
    """Ctrl-C while a plugin was imported, naming it: still a ``KeyboardInterrupt``, so whatever stops on Ctrl-C
    still stops, and the CLI prints this one line and exits 130, not a traceback through the plugin's import."""


class InvalidPluginError(AttnhostError, ValueError):
    """An in-process plugin object that cannot be registered."""


class PluginProblem(Exception):
    """Internal: why a plugin object cannot be registered (the message completes "plugin X ...: "). It never
    leaves attnhost: the loader makes it a failed plugin record, or :class:`InvalidPluginError` in-process."""


class NoForwardContextError(AttnhostError, RuntimeError):
    """Attention was dispatched outside ``ModelRunner.forward_context()``."""


class KVPoolFullError(AttnhostError, RuntimeError):
    """The KV pool has too few free token slots or request slots for an allocation."""


class RankCheckError(AttnhostError, RuntimeError):
    """The rank agreement check could not complete (e.g. a rank never joined before the group's timeout)."""


class RankMismatchError(RankCheckError):
    """Ranks discovered different plugins or resolved different backends; raised on every rank."""


def printable(text: str) -> str:
    """``text`` with whatever ``str.isprintable`` rejects written as ``repr`` escapes it (``\\x1b``, ``\\u202e``):
    plugin text reaches terminals and logs, where an escape sequence could clear the screen or forge output and a
    bidi override reorder what is seen. Applying it twice changes nothing more."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def printable_record(record: logging.LogRecord) -> bool:
    """A logging filter that makes a record's message :func:`printable` (it never drops one), so plugin text
    reaches no log handler, attnhost's or an application's, with a control sequence in it."""
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: leave it to the handler's own error reporting
        return True
    shown = printable(message)
    if shown != message:
        record.msg, record.args = shown, None
    return True


def plugin_label(name: str, distribution: str | None, version: str | None) -> str:
    """``plugin 'x' (distribution y 1.0)``: how every message names a plugin (escaped: it is plugin text)."""
    if distribution is None:
        return f"plugin {printable(repr(name))} (registered in-process)"
    return f"plugin {printable(repr(name))} (distribution {printable(str(distribution))} {printable(str(version))})"


def one_line(text: str) -> str:
    """``text`` with line breaks folded into spaces and the rest :func:`printable`: every warning is one line."""
    return printable(" ".join(text.split()))


def bounded(text: str, limit: int = 200) -> str:
    """``text``, or its first ``limit`` characters and how many there were: outside text echoed in a message (a
    100,000-character name) must not make a 100 kB line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def safe_repr(obj: object, limit: int = 60) -> str:
    """A one-line, bounded ``repr`` that survives objects whose ``__repr__`` raises (hostile plugins)."""
    try:
        text = one_line(repr(obj))
    except Exception:  # a plugin's __repr__ is other people's code
        text = f"<{type(obj).__name__} object with a broken __repr__>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_exception(exc: BaseException) -> str:
    """``ValueError: message`` on one line, as warnings and ``attnhost plugins`` show it; the message is a
    plugin's own ``__str__``, which may span lines or even raise without breaking the host or its output."""
    try:
        lines = str(exc).strip().splitlines()
    except Exception:
        lines = ["<exception with a broken __str__>"]
    kind = printable(type(exc).__name__)
    return f"{kind}: {one_line(lines[0])}" if lines and lines[0].strip() else kind


def backend_failed(
    where: str, origin: str, method: str, mode: str, layer_id: int | None, exc: BaseException
) -> BackendFailedError:
    """The one sentence an engine bridge raises when the backend it runs raised: ``where`` names the backend and
    the engine's name for it, ``origin`` its plugin and distribution; the plugin's exception is the cause."""
    at = "" if layer_id is None else f", layer {layer_id}"
    return BackendFailedError(
        f"{where} failed in {method} ({mode} batch{at}): {describe_exception(exc)}; report this to the maintainers "
        f"of {origin}, or choose another --attention-backend"
    )
