"""Session fixtures for the real-SGLang tests: the test-only plugins, the tiny model and HF's reference ids.

Everything here is test scaffolding (see README.md). The tests in this
directory need SGLang installed (the ``sglang`` tox environment); elsewhere
they are not collected.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the sgl_* helper modules next to this file

from sgl_e2e import NEW_TOKENS, TinyModel

try:
    importlib.metadata.distribution("sglang")
except importlib.metadata.PackageNotFoundError:
    # Asked by distribution, not by module: with tests/ on sys.path this directory is itself a namespace
    # package called "sglang".
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def sglang_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sgl_scaffold import install_test_plugins

    return install_test_plugins(tmp_path_factory.mktemp("sglang-site"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    import sgl_tiny_model as tm

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.build_model(path)
    prompts = tm.prompt_ids(path)
    hf_ids = tm.hf_greedy(path, prompts, NEW_TOKENS)
    assert all(len(ids) == NEW_TOKENS for ids in hf_ids)
    assert hf_ids[0] != hf_ids[1]  # two different continuations, so a mixed-up batch cannot pass
    return TinyModel(path, prompts, hf_ids)
