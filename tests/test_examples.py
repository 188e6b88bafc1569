"""The example plugins in ``examples/``, built as wheels and installed the way users install them.

Each example is copied out of the tree (setuptools writes ``build/`` and
``*.egg-info`` next to the sources), built with ``pip wheel`` and installed
with ``pip install --no-deps --target`` into a directory that the
subprocesses get on ``PYTHONPATH``: a real installed distribution, seen by
``attnhost`` and by ``pytest`` exactly as after ``pip install``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import kit_run_problems, list_json, run_cli, run_python, subprocess_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BUILD_ONCE = EXAMPLES.parent / "tools" / "install_built_once.py"
# backend name -> (example directory, distribution, version, plugin name)
BACKENDS = {
    "batched_matmul": ("attnhost-batched", "attnhost-batched", "0.2.0", "batched"),
    "tiny": ("attnhost-tiny", "attnhost-tiny", "0.1.0", "tiny"),
    "cpu_paged": ("attnhost-cpukernels", "attnhost-cpukernels", "0.1.0", "cpukernels"),  # a C++ extension
}
#: Why a kit test of an example may skip: a capability it does not declare (tiny and batched_matmul: flat_heads;
#: tiny and cpu_paged: mla and the attention variants; all three: FP8 caches), or the refusal check
#: of one it does (batched_matmul declares mla).
NOT_DECLARED = (
    "does not declare the FP8 cache",
    "does not declare flat_heads",
    "does not declare mla",
    "declares mla",
    *(f"does not declare {flag}" for flag in ("sliding_window", "logit_cap", "sinks", "non_causal")),
)
# A compiled example is built against torch: where there is none (py312, py313), only the others are.
BUILT = {
    name: example
    for name, example in BACKENDS.items()
    if name != "cpu_paged" or importlib.util.find_spec("torch") is not None
}


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def _pip(*args: str, cwd: Path) -> None:
    _run([sys.executable, "-m", "pip", *args, "--no-deps", "--disable-pip-version-check", "--no-input", "-q"], cwd=cwd)


def _run(command: list[str], *, cwd: Path) -> None:
    """Run a build or install step without an index, failing the test with its output."""
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(env={"PIP_NO_INDEX": "1"}),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example-sources")
    ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.so")
    for directory, *_ in BUILT.values():
        shutil.copytree(EXAMPLES / directory, root / directory, ignore=ignore)
    return root


@pytest.fixture(scope="module")
def site(sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The examples built as wheels and installed into one target directory. The compiled one (built against this
    env's torch, about 40 s on two cores) goes through ``tools/install_built_once.py``, as the engine environments
    install it: under tox its cache is the run's (``ATTNHOST_TEST_BUILT_ONCE``), so the build is shared with them,
    whichever comes first; elsewhere a temporary one, so it is built here."""
    wheels = tmp_path_factory.mktemp("wheels")
    target = tmp_path_factory.mktemp("site")
    pure = [directory for name, (directory, *_) in BUILT.items() if name != "cpu_paged"]
    _pip("wheel", "--no-build-isolation", "-w", str(wheels), *[str(sources / d) for d in pure], cwd=sources)
    built = sorted(wheels.glob("*.whl"))
    assert [w.name.split("-")[0] for w in built] == sorted(d.replace("-", "_") for d in pure)
    _pip("install", "--target", str(target), *map(str, built), cwd=wheels)
    if "cpu_paged" in BUILT:
        cache = os.environ.get("ATTNHOST_TEST_BUILT_ONCE") or str(tmp_path_factory.mktemp("built-once"))
        project = sources / BUILT["cpu_paged"][0]
        _run([sys.executable, str(BUILD_ONCE), cache, str(project), "--target", str(target)], cwd=sources)
    installed = sorted(p.name.split("-")[0] for p in target.glob("*.dist-info"))
    assert installed == sorted(dist.replace("-", "_") for _, dist, *_ in BUILT.values()), installed
    return target


@pytest.mark.torch  # the examples implement their backends with torch
def test_list_shows_them_with_distribution_and_version(site: Path) -> None:
    data = list_json([site])
    backends: dict[str, dict[str, Any]] = {row["name"]: row for row in data["backends"]}
    for name, (_, dist, version, plugin) in BACKENDS.items():
        row = backends[name]
        assert (row["distribution"], row["version"], row["plugin"]) == (dist, version, plugin)
        assert row["roles"] == ["target", "draft"]
        assert row["implemented"] and row["available"], row
        assert row["description"]
    assert (
        backends["tiny"]["description"]
        == "Per-request einsum attention in float32, in about fifty lines (example plugin)."
    )
    plugins = {p["name"]: p["status"] for p in data["plugins"]}
    assert plugins["batched"] == plugins["tiny"] == "loaded"
    result = run_cli("list", "--draft", "--wide", path_entries=[site])
    assert result.returncode == 0, result.stderr
    for name, (_, dist, version, _plugin) in BACKENDS.items():
        line = next(line for line in result.stdout.splitlines() if line.startswith(name + " "))
        assert f"{dist} {version}" in line


def test_listing_imports_neither_torch_nor_a_kernel(site: Path) -> None:
    code = (
        "import io, json, sys\n"
        "from attnhost.cli import main\n"
        "assert main(['list'], out=io.StringIO()) == 0\n"
        "kernels = ('attnhost_batched.backend', 'attnhost_cpukernels.backend', '_attnhost_cpukernels')\n"
        "print(json.dumps([m for m in ('torch', *kernels) if m in sys.modules]))\n"
    )
    result = run_python(code, path_entries=[site])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.torch  # availability of the examples' backends is torch's
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_resolve_accepts_them_as_draft_backends(site: Path, name: str) -> None:
    result = run_cli("resolve", "--speculative-draft-attention-backend", name, "--json", path_entries=[site])
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["draft"] == name and not payload["draft_fell_back"]
    assert payload["availability"]["draft"]["available"]
    text = run_cli(
        "resolve", "--attention-backend", name, "--speculative-draft-attention-backend", name, path_entries=[site]
    )
    assert text.returncode == 0, text.stderr
    assert f"draft: '{name}' is draft-capable; using it" in text.stdout


def _pytest(args: list[str], *, cwd: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(cwd / ".xdg-cache")}),
        timeout=1200,  # a hang guard only: the examples' suites take minutes on two busy cores
    )


@pytest.mark.torch  # the examples implement their backends with torch
def test_examples_own_test_suites_pass(site: Path, sources: Path) -> None:
    """What each example's author runs in CI: `pytest` in the package, one subclass of the kit."""
    proc = _pytest([f"{d}/tests" for d, *_ in BACKENDS.values()], cwd=sources, site=site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the kit's tests for each example (what an example does not declare skips), and cpu_paged's own kernel and
    # safety tests (tree masks, strided caches, int32 tables, shared slots, threads, its cache write, bad input)
    assert kit_run_problems(proc.stdout, NOT_DECLARED) == [], proc.stdout[-3000:]


@pytest.mark.torch  # the examples implement their backends with torch
def test_pytest_option_runs_the_kit_against_them_without_a_test_file(site: Path, tmp_path: Path) -> None:
    names = [arg for name in BACKENDS for arg in ("--attnhost-backend", name)]
    proc = _pytest(names, cwd=tmp_path, site=site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert kit_run_problems(proc.stdout, NOT_DECLARED) == [], proc.stdout[-3000:]


@pytest.mark.torch  # the compiled example is built against torch
def test_a_kernel_that_does_not_compile_ends_the_build_in_one_line(sources: Path, tmp_path: Path) -> None:
    """A compiler that cannot build the kernel (here, a source that does not compile) ends pip's build output with
    one line naming the package, the torch it was built against and the way out, below the compiler's error."""
    broken = tmp_path / "attnhost-cpukernels"
    shutil.copytree(sources / "attnhost-cpukernels", broken)
    for source in (broken / "csrc").glob("*.cpp"):  # each fails at once, whichever ninja compiles first
        source.write_text('#include "a_header_this_compiler_lacks.h"\n' + source.read_text())  # fatal: stops at once
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "wheels"),
            str(broken),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=subprocess_env(env={"MAX_JOBS": "1"}),  # one compiler at a time: the first error stops the build
        timeout=600,
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    output = (proc.stdout + proc.stderr).splitlines()
    build = [line.strip() for line in output[: next(i for i, line in enumerate(output) if "[end of output]" in line)]]
    assert build[-1].startswith(
        f"attnhost-cpukernels: its C++ kernel did not compile against torch {torch_version()} ("
    ), build[-3:]
    assert "install a newer g++ or clang, or a torch release this compiler supports" in build[-1], build[-1]
    assert any("fatal error: a_header_this_compiler_lacks.h" in line for line in build), build[-20:]


@pytest.mark.torch  # the compiled example is built against torch
@pytest.mark.parametrize(
    "suffix", [None, ".cpython-311-aarch64-linux-gnu.so"], ids=["never-built", "built-for-another-platform"]
)
def test_compiled_kernel_missing_is_one_line_with_the_way_out(site: Path, tmp_path: Path, suffix: str | None) -> None:
    """Without its compiled module (a checkout never built, a wheel for another platform) cpu_paged is listed
    as unavailable, with the way out, and listing still imports neither torch nor the kernel."""
    copy = tmp_path / "site"
    shutil.copytree(site, copy, symlinks=True)
    (built,) = copy.glob("_attnhost_cpukernels.*")
    if suffix is None:
        built.unlink()
    else:
        built.rename(copy / f"_attnhost_cpukernels{suffix}")
    row = next(row for row in list_json([copy])["backends"] if row["name"] == "cpu_paged")
    assert not row["available"]
    assert row["reason"] == "module '_attnhost_cpukernels' is not installed (reinstall attnhost-cpukernels)"
    result = run_cli("list", "--wide", path_entries=[copy])
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("cpu_paged ")]
    assert "no" in line
    code = (
        "import io, json, sys\n"
        "from attnhost.cli import main\n"
        "assert main(['list'], out=io.StringIO()) == 0\n"
        "print(json.dumps([m for m in ('torch', 'attnhost_cpukernels.backend') if m in sys.modules]))\n"
    )
    listed = run_python(code, path_entries=[copy])
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []


@pytest.mark.torch  # the examples implement their backends with torch
def test_speculative_demo_drafts_on_the_installed_plugin(site: Path) -> None:
    """With an example plugin installed, the demo's draft runner uses it; the target stays on torch_native."""
    demo = EXAMPLES / "speculative_demo.py"
    result = subprocess.run(
        [sys.executable, str(demo), "--steps", "12", "--k", "3"],
        capture_output=True,
        text=True,
        env=subprocess_env([site]),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "draft runner: BatchedMatmulAttnBackend from plugin 'batched' (attnhost-batched 0.2.0)" in out
    assert "target runner: TorchNativeAttnBackend from plugin 'builtin'" in out
    assert "DRAFT_EXTEND     -> batched_matmul" in out and "TARGET_VERIFY    -> torch_native" in out
    assert "speculative output equals the target's own greedy output: yes" in out
    tree = subprocess.run(  # the plugin decodes the draft's branch rows; torch_native verifies the tree
        [sys.executable, str(demo), "--steps", "12", "--k", "3", "--topk", "2"],
        capture_output=True,
        text=True,
        env=subprocess_env([site]),
        timeout=300,
    )
    assert tree.returncode == 0, tree.stdout + tree.stderr
    assert "DECODE           -> batched_matmul" in tree.stdout and "(trees of 2 branches x 3)" in tree.stdout
