"""The conformance kit plugin authors run in their own CI.

Write ``class TestMine(BackendConformance): backend_name = "mine"`` in a test
module and run ``pytest``; or run ``pytest --attnhost-backend mine`` with no
test file at all (the pytest plugin in :mod:`attnhost.testing.pytest_plugin`).

``BackendConformance`` is exported lazily: this package is also the home of
the pytest plugin, which pytest loads in *every* run once attnhost is
installed, so importing the package must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["BackendConformance"]


def __getattr__(name: str) -> Any:
    if name == "BackendConformance":
        from attnhost.testing.conformance import BackendConformance

        return BackendConformance
    raise AttributeError(f"module 'attnhost.testing' has no attribute {name!r}")


if TYPE_CHECKING:
    from attnhost.testing.conformance import BackendConformance
