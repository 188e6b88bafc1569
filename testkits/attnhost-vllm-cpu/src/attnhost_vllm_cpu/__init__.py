"""TEST-ONLY: attention backends checked inside the real vLLM 0.33 on a CPU-only machine.

``pytest --attnhost-backend NAME --attnhost-engine vllm`` runs :mod:`.suite`
(this distribution's ``attnhost.engine_suites`` entry point, its only one:
nothing here registers with vLLM, so installing the kit changes no vLLM
process). The PyPI vLLM wheel has no CPU build of ``vllm._C``, so no model
runs here; the suite checks what does run: vLLM's plugin loader, its enum of
backends, its argument parser and ``VllmConfig``, a spawned process, and the
forward on vLLM's own metadata and KV cache. The parts:

* :mod:`.kit`: batches as vLLM's scheduler hands them to a backend (vLLM's
  ``allocate_kv_cache`` and ``CommonAttentionMetadata``) with a float64 reference;
* :mod:`.forward`: the batch catalogue, one forward through a vLLM backend
  class, and the check whose failure names backend, case and error size;
* :mod:`.registration`: an attnhost name's vLLM member, or why there is none;
* :mod:`.config`: a config-only model directory and ``VllmConfig`` built by vLLM's own parser;
* :mod:`.spawn` / :mod:`.spawn_child`: a process started with vLLM's spawn method, and what it reports.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import os

__all__ = ["VLLM_ENV", "use_cpu_environment"]

#: What a vLLM process on this machine needs before vLLM is imported: the CPU paths (the wheel's ``vllm._C`` is a
#: CUDA build) and no download.
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}


def use_cpu_environment() -> None:
    """Set :data:`VLLM_ENV` in this process where the caller left it unset (call before importing vLLM)."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
