"""Every test starts from a fresh plugin host, a private cache directory and a clean environment."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/distgen.py and tests/helpers.py

from attnhost.host import _reset_for_tests

ATTNHOST_ENV = (
    "ATTNHOST_PLUGINS",
    "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD",
    "ATTNHOST_STRICT",
    "ATTNHOST_PLATFORM",
    "ATTNHOST_NO_CACHE",
    "ATTNHOST_DEBUG",
)


@pytest.fixture(autouse=True)
def fresh_host(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    for name in ATTNHOST_ENV:
        monkeypatch.delenv(name, raising=False)
    _reset_for_tests()
    yield
    _reset_for_tests()
