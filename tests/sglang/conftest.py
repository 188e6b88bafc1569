"""Tests that run attnhost inside the real SGLang (0.5.23): only in the ``sglang`` tox environment.

The default environment ignores this directory (``tox.ini``); run here
without SGLang installed, every test is skipped with the reason. The CPU
scaffolding is the test-only distribution ``attnhost-sglang-cpu``
(testkits/attnhost-sglang-cpu, installed by ``tox -e sglang``); these tests
only call it. SGLang imports torchvision at module level and PyPI's
torchvision cannot import beside the CPU torch, so the kit's shim is
installed in this process, and every script SGLang runs from here
(``probe_sglang.py``, the kit's ``run_engine`` and ``launch_server``) installs
it in its own.

Session fixtures: ``model_dir`` (a tiny Llama config, no weights, for
argument resolution) and ``tiny_model`` (the same shape with seeded weights and
a locally trained tokenizer, plus HF transformers' greedy ids).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent

try:
    # Asked by distribution, not by module: with tests/ on sys.path this directory is itself a namespace
    # package called "sglang".
    importlib.metadata.distribution("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed: run `tox -e sglang`", allow_module_level=True)

try:
    from attnhost_sglang_cpu import shim
except ImportError:
    pytest.fail(
        "the test-only kit attnhost-sglang-cpu is not installed: "
        "pip install --no-deps testkits/attnhost-sglang-cpu (tox -e sglang does)",
        pytrace=False,
    )

shim.install()

from attnhost_sglang_cpu.e2e import TinyModel  # noqa: E402

#: Greedy ids generated per prompt by every engine test.
NEW_TOKENS = 8


def run_probe(
    spec: Mapping[str, Any],
    *,
    path_entries: Iterable[Path] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 400,
) -> dict[str, Any]:
    """Run ``probe_sglang.py`` in a fresh interpreter and return its report."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNHOST_", "SGLANG_PLUGINS"))}
    environ["PYTHONPATH"] = os.pathsep.join([*map(str, path_entries), os.environ.get("PYTHONPATH", "")])
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
    from attnhost_sglang_cpu.tiny_model import LLAMA_SHAPE
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-config")
    LlamaConfig(**LLAMA_SHAPE, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    import attnhost_sglang_cpu.tiny_model as tm

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.build_model(path)
    prompts = tm.prompt_ids(path)
    hf_ids = tm.hf_greedy(path, prompts, NEW_TOKENS)
    assert all(len(ids) == NEW_TOKENS for ids in hf_ids)
    assert hf_ids[0] != hf_ids[1]  # two different continuations, so a mixed-up batch cannot pass
    return TinyModel(path, prompts, hf_ids)
