"""The speculative-decoding demo runs end to end: each runner on its own backend, output exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import subprocess_env

DEMO = Path(__file__).resolve().parents[1] / "examples" / "speculative_demo.py"


pytestmark = pytest.mark.torch  # it runs model runners


def test_demo_runs_and_checks_itself() -> None:
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


@pytest.mark.parametrize("topk", [2, 3])
def test_demo_verifies_draft_trees(topk: int) -> None:
    """The draft proposes a tree on branch rows; the target verifies it in one TARGET_VERIFY with a tree mask."""
    result = _demo("--steps", "16", "--k", "3", "--topk", str(topk))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"draft proposals (trees of {topk} branches x 3); generated 16 tokens" in out
    assert "speculative output equals the target's own greedy output: yes" in out
    assert "each runner dispatched only to its own backend: yes" in out
    for mode in ("EXTEND", "TARGET_VERIFY", "DECODE", "DRAFT_EXTEND"):
        assert f"  {mode} " in out


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )


def test_demo_help_states_its_real_defaults() -> None:
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("speculative_demo", DEMO)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    parser: argparse.ArgumentParser = module.build_parser()
    result = _demo("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for action in parser._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        assert flag in text and action.help, flag
        if action.default is not None:
            assert f"(default: {action.default})" in " ".join(action.help.split()).replace(
                "%(default)s", str(action.default)
            ), flag
            assert f"(default: {action.default})" in text, flag
    assert "(default: 24)" in text and "(default: 4)" in text and "(default: 0)" in text
    assert "else torch_native" in text
    docstring_run = (module.__doc__ or "").split("Run:", 1)[1]
    assert all(flag in docstring_run for flag in ("--steps", "--k", "--topk", "--draft-backend", "--seed"))


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
        (["--k", "0"], 2, "argument --k: expected a positive integer, got 0"),
        (["--topk", "0"], 2, "argument --topk: expected a positive integer, got 0"),
        (["--steps", "many"], 2, "argument --steps: expected a positive integer, got 'many'"),
        (["--draft-backend", "flashinfr"], 2, "did you mean 'flashinfer'?"),
        (["--draft-backend", "flashinfer"], 1, "declared only: no installed plugin implements it"),
    ],
)
def test_demo_bad_input_is_one_line(args: list[str], status: int, message: str) -> None:
    result = _demo(*args)
    assert result.returncode == status, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculative_demo.py: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr
