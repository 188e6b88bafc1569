"""The plugin author's one command in real vLLM engines: ``pytest --attnhost-backend torch_native
--attnhost-engine vllm`` runs the engine kit's real-engine cases (generate, ngram / draft model / EAGLE speculative
decoding against an all-``CPU_ATTN`` engine's proposals, ``tensor_parallel_size=2`` equal to one rank) and they
pass. A file of its own, so that ``pytest -n 2 --dist loadfile`` runs it beside the other engine files.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("attnhost_vllm_engine_cpu", reason="the test-only vLLM CPU engine kit is not installed")

from helpers import pytest_command


def test_one_command_runs_the_real_engine_cases(tmp_path: Path) -> None:
    """One of the slow tests: the engine kit's cases for torch_native (generation, three speculative methods beside
    their all-CPU_ATTN references, two ranks), engine configurations no other test starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    env["PYTHONPATH"] = os.pathsep.join(
        str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
    )
    env["COLUMNS"] = "1000"
    command = pytest_command(
        "--attnhost-backend",
        "torch_native",
        "--attnhost-engine",
        "vllm",
        "-k",
        "TestVllmCpuEngine",
        "--basetemp",
        str(tmp_path / "base"),
    )
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0 and re.search(r"\b5 passed\b", summary), proc.stdout[-6000:] + proc.stderr[-2000:]
