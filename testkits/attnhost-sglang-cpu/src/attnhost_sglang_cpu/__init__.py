"""TEST-ONLY: what lets a real SGLang 0.5.23 engine run on a CPU-only machine, so attention backends can be tested.

Nothing here is imported by attnhost, and nothing activates unless the test
platform is selected with ``SGLANG_PLATFORM=attnhost_test_cpu`` (see this
distribution's README.md). The parts:

* :mod:`.platform`: the out-of-tree SGLang platform (``sglang.srt.platforms``
  entry point ``attnhost_test_cpu``), torch-only code paths, speculative
  decoding allowed; with ``ATTNHOST_TEST_CPU_GRAPHS=1`` its graph variant, which
  runs SGLang's own ``CPUGraphRunner`` (:mod:`.compile_ops`: stand-ins for the
  ``sgl_kernel`` operators that runner registers fake kernels for);
* :mod:`.plugin`: a general SGLang plugin that, on that platform only, puts
  pure-torch stand-ins (:mod:`.spec_kernels`) in place of the two tree kernels
  SGLang refuses to run on an out-of-tree platform;
* :mod:`.probe`: a general SGLang plugin recording which backend each model
  runner built and which forward modes it ran (only with ``ATTNHOST_TEST_PROBE_FILE``);
* :mod:`.shim`: the torchvision import shim;
* :mod:`.tiny_model`: a tiny seeded Llama, tokenizer, draft models and HF's greedy ids;
* :mod:`.run_engine` / :mod:`.launch_server`: drivers that run ``sglang.Engine`` and the HTTP server;
* :mod:`.reference_check`: attnhost's float64 reference on SGLang's own dense batches, at attnhost's tolerance;
* :mod:`.speculative_demo`: speculative decoding by hand in a real engine (docs/speculative-cpu.md);
* :func:`sglang_env` and :mod:`.procs`: the environment and process-group helpers a test runs them with.

This module imports neither torch nor SGLang.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["PLATFORM_NAME", "PROBE_ENV", "SPECULATIVE_ENV", "driver_command", "platform_selected", "sglang_env"]

#: The platform's entry-point name, which is also the value ``SGLANG_PLATFORM`` must have.
PLATFORM_NAME = "attnhost_test_cpu"
#: The probe writes JSON lines to the file this names; unset, it records nothing.
PROBE_ENV = "ATTNHOST_TEST_PROBE_FILE"

#: What a speculative engine run needs on a CPU besides the platform: SGLang's speculative workers launch
#: triton kernels (cache locations, KV indices, bonus tokens), which run here only in triton's interpreter, and
#: its draft selection is ``torch.compile``d, which inductor would compile with a C++ toolchain for minutes.
SPECULATIVE_ENV = {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"}


def platform_selected() -> bool:
    """Whether this process runs SGLang on the test platform (the one switch every part of the kit obeys)."""
    return os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME


def sglang_env(extra: Mapping[str, str] | None = None, *, path_entries: Sequence[str] = ()) -> dict[str, str]:
    """The environment a real SGLang process runs in here: the test platform selected, nothing downloaded, and no
    attnhost or SGLang settings inherited from the caller's shell. *path_entries* go first on ``PYTHONPATH``
    (plugins a test wrote as distributions); *extra* is applied last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNHOST_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*path_entries, env.get("PYTHONPATH", "")) if p)
    env.update(
        {
            "SGLANG_PLATFORM": PLATFORM_NAME,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def driver_command(driver: str, *args: str) -> list[str]:
    """``python -m attnhost_sglang_cpu.DRIVER ARGS`` with this interpreter (*driver*: ``run_engine`` or
    ``launch_server``)."""
    if driver not in ("run_engine", "launch_server"):
        raise ValueError(f"unknown attnhost-sglang-cpu driver {driver!r}: use 'run_engine' or 'launch_server'")
    return [sys.executable, "-m", f"attnhost_sglang_cpu.{driver}", *args]
