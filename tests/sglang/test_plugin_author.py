"""The engine kit tried as a stranger would: a plugin written from the plugin guide, checked in SGLang.

A kernel author copies the plugin guide's ``pyproject.toml``, hooks module
and kernel into a fresh package, installs it with pip (a real build and a
real install, into a folder on ``PYTHONPATH``), and runs the one command
``pytest --attnhost-backend acme --attnhost-engine sglang`` from their own
directory. It must pass as a whole. The same package with one mistake in
its numerics (the softmax scale doubled) must fail, and its first failure
must name the backend, SGLang's dense case and the size of the error.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from attnhost_sglang_cpu.dense import DTYPES, dense_cases
from helpers import guide_block, kit_run_problems, plugin_guide, subprocess_env

#: The suite's engine cases: plain engine, tp_size=2 and speculative chain, each also with --page-size 16 (the guide's
#: backend declares any page size, but neither tree masks, non_causal nor the variants' flags, so the trees, DFLASH
#: and the variant models skip).
ENGINE_CASES = 6


def _author_package(root: Path, *, wrong_numerics: bool = False) -> Path:
    """The guide's three files as a package directory, optionally with the softmax scale doubled."""
    guide = plugin_guide()
    kernels = guide_block(guide, "# acme_attn/kernels.py")
    if wrong_numerics:
        assert "* layer.scaling" in kernels, "the guide's kernel no longer scales by layer.scaling"
        kernels = kernels.replace("* layer.scaling", "* layer.scaling * 2")
    package = root / "acme-attn"
    (package / "acme_attn").mkdir(parents=True)
    (package / "pyproject.toml").write_text(guide_block(guide, "# pyproject.toml"))
    (package / "acme_attn" / "__init__.py").write_text(guide_block(guide, "# acme_attn/__init__.py"))
    (package / "acme_attn" / "kernels.py").write_text(kernels)
    return package


def _install_and_run(
    tmp_path: Path, *pytest_args: str, wrong_numerics: bool = False
) -> subprocess.CompletedProcess[str]:
    package = _author_package(tmp_path / "src", wrong_numerics=wrong_numerics)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"]
    installed = subprocess.run([*pip, str(site), str(package)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, f"pip could not install the guide's package:\n{installed.stderr}"
    workdir = tmp_path / "author"
    workdir.mkdir()
    command = [sys.executable, "-m", "pytest", "--attnhost-backend", "acme", "--attnhost-engine", "sglang"]
    return subprocess.run(
        [*command, "-p", "no:cacheprovider", "-q", "-rfs", *pytest_args],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "400"}),
        timeout=1800,  # a hang guard: the kit's engine runs, two with two ranks, on busy cores
    )


def test_the_guides_plugin_passes_the_engine_kit(tmp_path: Path) -> None:
    """One of the slow tests: the whole engine kit, whose engine cases start the guide's backend in engines (plain,
    paged, two ranks, a speculative chain) that no other test starts."""
    proc = _install_and_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # registration, every dense case in the three declared dtypes, the verify kit's chains, the engine cases;
    # what the guide's backend does not declare (tree masks, MLA, the variants) skips, and nothing else does
    assert kit_run_problems(proc.stdout, ("does not declare ",)) == [], proc.stdout[-3000:]
    assert "does not declare tree masks" in proc.stdout
    passed = int(re.findall(r"(\d+) passed", proc.stdout)[-1])
    assert passed >= 1 + len(dense_cases("acme")) * len(DTYPES) + ENGINE_CASES, proc.stdout[-3000:]


def test_a_plugin_with_wrong_numerics_fails_with_the_case_and_the_error_size(tmp_path: Path) -> None:
    proc = _install_and_run(tmp_path, "-x", wrong_numerics=True)
    assert proc.returncode == 1, proc.stdout[-6000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 1 and "test_sglang_dense_kit[" in failed[0], proc.stdout[-6000:]
    # the failure is its message alone (no traceback), which says what broke, where and by how much
    first = next(line for line in proc.stdout.splitlines() if line.startswith("backend 'acme', "))
    reason = re.search(r"backend 'acme', SGLang dense case '([^']+)' \((\w+)\): max abs error (\S+) at", first)
    assert reason, first
    case, dtype, size = reason.groups()
    assert case in {c.name for c in dense_cases("acme")} and dtype == "float32", first
    assert float(size) > 1e-2, first
    assert reason.group(0) in failed[0], failed[0]  # and the short summary repeats it
