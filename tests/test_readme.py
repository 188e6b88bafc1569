"""The README's Python example runs as written (documentation that drifts is a bug)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_python

README = Path(__file__).resolve().parents[1] / "README.md"


pytestmark = pytest.mark.torch  # it runs model runners


def test_python_example_runs_and_dispatches_per_runner() -> None:
    block = re.search(r"In Python:\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md lost its 'In Python:' example"
    code = block.group(1) + (
        "\nwith target.forward_context():\n"
        "    assert attnhost.dispatch_attention_backend(ForwardMode.DECODE) == 'torch_native'\n"
        "    assert attnhost.get_attn_backend() is target.attn_backend\n"
        "with draft.forward_context():\n"
        "    assert attnhost.get_attn_backend() is draft.attn_backend\n"
        "print('ok')\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
