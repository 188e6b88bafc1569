"""Every test starts from a fresh plugin host, a private cache directory and a clean environment."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/distgen.py and tests/helpers.py

from attnhost.host import _reset_for_tests

#: The slowest test files (engine starts, whole kit runs, compiled builds), slowest first. tox runs ``pytest -n 2
#: --dist loadfile``, which hands a worker the next file when it finishes one: a slow file left for last keeps one
#: worker busy while the other idles, so these go first and the quick files fill the gaps behind them. A file not
#: named keeps its place after them.
SLOWEST_FIRST = (
    "sglang/test_speculative.py",
    "sglang/test_variants_engine.py",
    "sglang/test_plugin_author.py",
    "sglang/test_tensor_parallel.py",
    "sglang/test_mla_engine.py",
    "sglang/test_engine.py",
    "sglang/test_dflash.py",
    "sglang/test_graphs_engine.py",
    "sglang/test_kv_formats_engine.py",
    "sglang/test_bridge_names.py",
    "sglang/test_bridge.py",
    "vllm/test_engine_kit.py",
    "vllm_engine/test_one_command.py",
    "vllm_engine/test_engine_cpu.py",
    "vllm/test_tensor_parallel.py",
    "test_examples.py",
    "test_conformance.py",
    "test_kit_production_shapes.py",
    "test_readme.py",
)

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: a file's own tests keep their order
