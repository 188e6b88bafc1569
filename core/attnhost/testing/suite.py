"""The suite ``pytest --attnhost-backend NAME`` collects (see :mod:`attnhost.testing.pytest_plugin`).

Not named ``test_*.py`` on purpose: it is collected only when the option adds
it to pytest's arguments, never by a project's own test discovery.
"""

from __future__ import annotations

from typing import ClassVar

from attnhost.testing.conformance import BackendConformance

__all__ = ["TestBackendConformance"]


class TestBackendConformance(BackendConformance):
    """The kit against each backend named on the command line (the plugin parametrizes the name)."""

    attnhost_cli_suite: ClassVar[bool] = True
