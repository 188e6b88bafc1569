"""vLLM 0.33 on the CPU: its plugin loader, registry, config parsing and attention base classes, for real.

``VLLM_TARGET_DEVICE=cpu`` before vLLM is imported: the CUDA build of
``vllm._C`` is never needed for these paths. attnhost registers through
vLLM's own ``load_general_plugins()`` once per test process (vLLM's loader
runs once per process by design); scenarios that need other environment
settings run in their own interpreter (see ``scenarios.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnhost_vllm_cpu import use_cpu_environment

use_cpu_environment()  # before anything imports vLLM
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def vllm_plugins_loaded() -> None:
    """What every vLLM process does first: vLLM's own general-plugin loader, with attnhost's entry point."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from attnhost_vllm_cpu.triton_rule import answer_x86_triton_rule

    answer_x86_triton_rule()  # vLLM >= 0.34 refuses an x86 VllmConfig without triton-cpu (the kit's module says why)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local model directory (config only): vLLM's config parsing needs no download and no weights."""
    from attnhost_vllm_cpu.config import write_tiny_model

    return write_tiny_model(Path(tmp_path_factory.mktemp("tiny-llama")))
