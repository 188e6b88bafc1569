"""attnhost's SGLang plugin failing to load is loud in every SGLang process, with its cause and the way out.

The environment is real: this one's site-packages as links, less ``importlib_metadata`` (attnhost installed with
``pip install --no-deps`` beside an SGLang that does not need it), run with ``python -S``. SGLang's own
``load_plugins()`` runs in the probe and again in a process it spawns, as in a scheduler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import importlib_metadata
from conftest import HERE


def _site_without(root: Path, prefix: str) -> Path:
    root.mkdir()
    site_packages = Path(importlib_metadata.__file__).parents[1]
    for item in site_packages.iterdir():
        if not item.name.startswith(prefix):
            os.symlink(item, root / item.name)
    return root


def test_a_missing_dependency_is_one_error_naming_attnhost_the_cause_and_the_fix(tmp_path: Path) -> None:
    site = _site_without(tmp_path / "site", "importlib_metadata")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNHOST_", "SGLANG_PLUGINS"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(site)) if p)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no entry-point cache: the scan needs importlib_metadata
    result = subprocess.run(
        [sys.executable, "-S", str(HERE / "probe_sglang.py"), json.dumps({"spawn": True})],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE-JSON ")]
    assert result.returncode == 0 and lines, result.stderr[-6000:]
    report = json.loads(lines[-1].removeprefix("PROBE-JSON "))
    assert report["attnhost_factories"] == [] and report["spawned"]["attnhost_factories"] == []
    for where, logs in (("the main process", report["logs"]), ("the spawned process", report["spawned"]["logs"])):
        errors = [r["message"] for r in logs if r["logger"].startswith("attnhost") and r["level"] == "ERROR"]
        assert len(errors) == 1, f"{where}: {logs}"
        message = errors[0]
        assert message.startswith("attnhost could not register its attention backends with SGLang"), message
        assert "No module named 'importlib_metadata'" in message, message
        assert "pip install 'importlib-metadata>=8'" in message, message
        assert "\n" not in message
