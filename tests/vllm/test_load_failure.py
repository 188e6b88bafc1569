"""attnhost's vLLM plugin failing to load says so first, naming attnhost, the cause and the way out.

The environment is real: this one's site-packages as links, less ``importlib_metadata`` (attnhost installed with
``pip install --no-deps``), run with ``python -S``; vLLM's own ``load_general_plugins()`` loads the plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import importlib_metadata


def test_a_missing_dependency_is_one_error_line_before_vllm_stops(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    site_packages = Path(importlib_metadata.__file__).parents[1]
    for item in site_packages.iterdir():
        if not item.name.startswith("importlib_metadata"):
            os.symlink(item, site / item.name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNHOST_", "VLLM_PLUGINS"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(site)) if p)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no entry-point cache: the scan needs importlib_metadata
    code = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0  # vLLM does not go on without a plugin that raised
    ours = [line for line in result.stderr.splitlines() if line.startswith("attnhost could not register")]
    assert len(ours) == 1, result.stderr[-4000:]
    assert "with vLLM in this process (MainProcess, pid " in ours[0]
    assert "No module named 'importlib_metadata'" in ours[0] and "pip install 'importlib-metadata>=8'" in ours[0]
    assert result.stderr.index(ours[0]) < result.stderr.index("Traceback")  # the explanation comes first
