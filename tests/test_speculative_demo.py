"""The speculative-decoding demo runs end to end: each runner on its own backend, output exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import subprocess_env

DEMO = Path(__file__).resolve().parents[1] / "examples" / "speculative_demo.py"


pytestmark = pytest.mark.torch  # it runs model runners


def test_demo_runs_and_checks_itself() -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "16", "--k", "3"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "speculative output equals the target's own greedy output: yes" in out
    assert "each runner dispatched only to its own backend: yes" in out
    for mode in ("EXTEND", "TARGET_VERIFY", "DECODE", "DRAFT_EXTEND"):
        assert f"  {mode} " in out
