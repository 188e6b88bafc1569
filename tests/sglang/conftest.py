"""Tests that run attnhost inside the real SGLang (0.5.23): only in the ``sglang`` tox environment.

The default environment ignores this directory (``tox.ini``); run here
without SGLang installed, every test is skipped with the reason. Test
scaffolding lives beside the tests and nowhere else: ``shims/torchvision``
(see its docstring) is put first on ``sys.path`` and on ``PYTHONPATH`` for
every subprocess, because SGLang imports torchvision at module level and
PyPI's torchvision cannot import beside the CPU torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
SHIMS = HERE / "shims"

pytest.importorskip("sglang", reason="SGLang is not installed: run `tox -e sglang`")
if str(SHIMS) not in sys.path:
    sys.path.insert(0, str(SHIMS))
os.environ["PYTHONPATH"] = os.pathsep.join([str(SHIMS), *filter(None, [os.environ.get("PYTHONPATH")])])


def run_probe(
    spec: Mapping[str, Any],
    *,
    path_entries: Iterable[Path] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 400,
) -> dict[str, Any]:
    """Run ``probe_sglang.py`` in a fresh interpreter and return its report."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNHOST_", "SGLANG_PLUGINS"))}
    environ["PYTHONPATH"] = os.pathsep.join([str(SHIMS), *map(str, path_entries), os.environ.get("PYTHONPATH", "")])
    environ.update(env or {})
    result = subprocess.run(
        [sys.executable, str(HERE / "probe_sglang.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE-JSON ")]
    assert result.returncode == 0 and lines, f"probe failed (exit {result.returncode}):\n{result.stderr[-6000:]}"
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("PROBE-JSON "))
    report["stderr"] = result.stderr
    return report


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama config (no weights): enough for SGLang's server-argument resolution."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-config")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    return path
