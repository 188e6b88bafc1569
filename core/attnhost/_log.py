"""``logger``: a stand-in for ``logging.getLogger("attnhost")`` that imports ``logging`` on first use.

Why: importing ``logging`` (with the ``traceback``, ``linecache``,
``tokenize`` and ``string`` modules it pulls in) costs 3-5 ms, a fifth of
what ``attnhost list`` may spend in total to stay faster than a bare
``importlib.metadata`` entry-point scan — and on a healthy install nothing is
ever logged. Modules write ``from attnhost._log import logger`` and call
``logger.warning(...)`` exactly as they would on the real logger; records
carry the caller's file, line and function (``stacklevel`` is adjusted), so
``caplog`` and handlers see no difference.

The CLI needs its handler installed before the first message; it registers
it with :func:`on_first_use` instead of importing ``logging`` up front.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging
    from collections.abc import Callable

__all__ = ["LOGGER_NAME", "LazyLogger", "cancel", "get_logger", "logger", "on_first_use"]

LOGGER_NAME = "attnhost"

_pending: list[Callable[[logging.Logger], None]] = []


def get_logger() -> logging.Logger:
    """The real ``attnhost`` logger; imports ``logging`` and runs pending :func:`on_first_use` callbacks."""
    import logging

    real = logging.getLogger(LOGGER_NAME)
    while _pending:
        _pending.pop(0)(real)
    return real


def on_first_use(callback: Callable[[logging.Logger], None]) -> None:
    """Call ``callback(logger)`` now if ``logging`` is already imported, else just before the first message.

    "Already imported" matters: then something (a plugin, the embedding
    program) may log to ``attnhost`` directly, bypassing this module.
    """
    if "logging" in sys.modules:
        callback(get_logger())
    else:
        _pending.append(callback)


def cancel(callback: Callable[[logging.Logger], None]) -> bool:
    """Forget a callback that has not run yet; returns whether it was still pending."""
    try:
        _pending.remove(callback)
    except ValueError:
        return False
    return True


class LazyLogger:
    """Forwards ``warning``/``error``/``info``/``debug`` (and any other attribute) to the real logger."""

    __slots__ = ()

    def _log(self, level: str, msg: object, args: tuple[object, ...], kwargs: dict[str, Any]) -> None:
        # 1 would name this method, 2 the forwarding method, 3 our caller.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        getattr(get_logger(), level)(msg, *args, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._log("debug", msg, args, kwargs)

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._log("info", msg, args, kwargs)

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._log("warning", msg, args, kwargs)

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        self._log("error", msg, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(get_logger(), name)


logger = LazyLogger()
