"""The README's Python example runs as written (documentation that drifts is a bug)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import guide_block, kit_run_problems, plugin_guide, run_python

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


def test_plugin_guide_builds_a_backend_that_passes_the_conformance_kit(tmp_path: Path) -> None:
    """The guide's pyproject, hooks, kernel and test file, installed as written, pass the whole kit."""
    import subprocess
    import sys
    import tomllib

    from distgen import make_dist
    from helpers import subprocess_env

    guide = plugin_guide()
    project = tomllib.loads(guide_block(guide, "# pyproject.toml"))["project"]
    site = tmp_path / "site"
    make_dist(
        site,
        project["name"],
        project["version"],
        project["entry-points"],
        modules={
            "acme_attn": guide_block(guide, "# acme_attn/__init__.py"),
            "acme_attn.kernels": guide_block(guide, "# acme_attn/kernels.py"),
        },
    )
    author = tmp_path / "acme-attn"
    (author / "tests").mkdir(parents=True)
    (author / "tests" / "test_conformance.py").write_text(guide_block(guide, "# tests/test_conformance.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "tests"],
        capture_output=True,
        text=True,
        cwd=author,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(tmp_path / "cache")}),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # drafts and every dtype run; only what the guide's backend does not declare (flat_heads, tree_mask, mla) skips
    undeclared = ("does not declare flat_heads", "does not declare tree_mask", "does not declare mla")
    assert kit_run_problems(proc.stdout, undeclared) == [], proc.stdout
    assert "does not declare tree_mask" in proc.stdout and "is target-only" not in proc.stdout


def test_plugin_guide_documents_every_field_a_backend_reads() -> None:
    guide = plugin_guide()
    for name in (
        "req_pool_indices",
        "seq_lens_cpu",
        "prefix_lens",
        "extend_prefix_lens",
        "extend_seq_lens_cpu",
        "extend_start_loc_cpu",
        "out_cache_loc",
        "req_to_token",
        "k_buffer(layer_id)",
        "set_kv(layer_id, loc, k, v)",
        "strided views",
        "layer.scaling",
        "layer.num_kv_heads",
        "save_kv_cache",
        "BackendCapabilities",
        "by default is\n  `forward_extend`",
        "first result wins",
        "`None` lets the next one answer",
        "--index-url https://download.pytorch.org/whl/cpu",
        "attnhost[test]",
    ):
        assert name in guide, name
    for hook in ("attnhost_attention_backends", "attnhost_draft_attention_backends", "attnhost_draft_fallback"):
        assert f"`{hook}(" in guide, hook
    from attnhost.hooks import HOOK_NAMES

    assert all(f"`{hook}(" in guide for hook in HOOK_NAMES), "every hook has a row in the guide's table"
