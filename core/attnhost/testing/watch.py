"""The kit's warning for a backend whose factory import or build runs long, printed while pytest waits.

Inside a test pytest captures stderr and the log and shows them only once the
test is over, so a factory that hangs would keep pytest silent for good. The
kit therefore reuses the watch that names a slow plugin import for
``attnhost list`` (:mod:`attnhost.discovery`: its thread and its threshold,
``SLOW_IMPORT_WARNING_S``) and writes that one warning to the terminal past the
capture, the way pytest's own live logging does.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import pytest

from attnhost import discovery
from attnhost.errors import printable

__all__ = ["watch_slow"]


class _ToTerminal(logging.Handler):
    """Writes the watch's record for one block to the terminal, with pytest's capture suspended meanwhile."""

    def __init__(self, config: pytest.Config, message: str) -> None:
        super().__init__(logging.WARNING)
        self._config = config
        self._message = message

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() != self._message:  # another warning of discovery's: not this block's
            return
        line = f"attnhost: warning: {self._message}"
        plugins = self._config.pluginmanager
        capture = plugins.getplugin("capturemanager")
        reporter = plugins.getplugin("terminalreporter")
        # The watch emits while it holds its lock, which the block's thread takes on leaving the block: the test
        # cannot move on (and change the capture state) while this writes.
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            if reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(line, yellow=True)
                reporter.flush()
            else:  # no terminal reporter (-p no:terminal): stderr, which the capture no longer holds
                sys.stderr.write(line + "\n")
                sys.stderr.flush()


@contextlib.contextmanager
def watch_slow(config: pytest.Config, doing: str, way_out: str) -> Iterator[None]:
    """Run the block; if it is still running after ``SLOW_IMPORT_WARNING_S``, print once, while it runs on,
    ``still <doing> after N s; <way_out>``. ``doing`` names the backend and its plugin (plugin text: escaped)."""
    message = printable(f"still {doing} after {discovery.SLOW_IMPORT_WARNING_S:g} s; {way_out}")
    logger = logging.getLogger(discovery.__name__)
    handler = _ToTerminal(config, message)
    logger.addHandler(handler)
    try:
        with discovery._WATCH.importing(message):
            yield
    finally:
        logger.removeHandler(handler)
