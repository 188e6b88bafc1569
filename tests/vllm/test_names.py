"""Engine names inside vLLM: case-folding never gives two backends one name, and an
override that does nothing says why. Each scenario is its own vLLM process (``scenarios.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from distgen import make_dist
from helpers import subprocess_env

FOLDED = """
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    return [BackendSpec(name=name, factory=factory, description=f"spelled {name}") for name in ("my-attn", "MY.ATTN")]
"""


def _scenario(paths: list[Path], env: dict[str, str]) -> dict[str, Any]:
    script = Path(__file__).with_name("scenarios.py")
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=subprocess_env(paths, {"VLLM_TARGET_DEVICE": "cpu", **env}),
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT: ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT: "))
    return result


def test_names_that_fold_to_one_vllm_name_keep_the_first_and_warn_naming_both(tmp_path: Path) -> None:
    make_dist(
        tmp_path,
        "folded-attn",
        "1.0",
        {"sglang.draft_attention_backends": {"folded": "folded_attn"}},
        modules={"folded_attn": FOLDED},
    )
    result = _scenario([tmp_path], {"ATTNHOST_VLLM_OVERRIDE": "fa4"})
    assert result["registered"].count("MY_ATTN") == 1
    warnings = [message for level, message in result["log"] if level == "WARNING"]
    clash = [m for m in warnings if "both become vLLM backend 'MY_ATTN'" in m]
    assert len(clash) == 1, warnings
    assert "'my-attn' (plugin 'folded'" in clash[0] and "'MY.ATTN' (plugin 'folded'" in clash[0]
    assert "'my-attn' keeps it" in clash[0]
    ignored = [m for m in warnings if m.startswith("ATTNHOST_VLLM_OVERRIDE names 'fa4'")]
    assert len(ignored) == 1 and "which vLLM does not get: declared only" in ignored[0], warnings
