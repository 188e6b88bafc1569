"""``tools/install_built_once.py``, as ``tox p`` runs it: two environments at once, one wheel built per source.

Two real projects (setuptools, built by pip) whose ``setup.py`` counts its wheel builds and takes a few seconds over
one, so that the two installs below overlap; each install names both projects and a ``--target`` of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("filelock", reason="the tool locks its builds with filelock (a dependency of torch)")

TOOL = Path(__file__).resolve().parent.parent / "tools" / "install_built_once.py"

SETUP = """\
import sys, time
from pathlib import Path
from setuptools import setup

if "bdist_wheel" in sys.argv:
    with open(Path(__file__).parent.parent / "builds.log", "a") as log:
        log.write("{name}\\n")
    time.sleep({seconds})
setup(name="{name}", version="1.0", py_modules=["{module}"])
"""


def _project(root: Path, name: str, seconds: float) -> Path:
    project = root / name
    project.mkdir(parents=True)
    module = name.replace("-", "_")
    (project / "setup.py").write_text(SETUP.format(name=name, module=module, seconds=seconds))
    (project / "pyproject.toml").write_text(
        textwrap.dedent("""\
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"
            """)
    )
    (project / f"{module}.py").write_text("VALUE = 1\n")
    return project


def _install(cache: Path, projects: list[Path], target: Path) -> subprocess.Popen[str]:
    command = [sys.executable, str(TOOL), str(cache), *map(str, projects), "--target", str(target)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _builds(root: Path) -> list[str]:
    log = root / "builds.log"
    return sorted(log.read_text().split()) if log.exists() else []


def test_two_installs_at_once_build_each_project_once_and_both_install_it(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    projects = [_project(sources, "slow-kit", seconds=4), _project(sources, "plain-kit", seconds=0)]
    cache = tmp_path / "cache"
    first, second = (_install(cache, projects, tmp_path / name) for name in ("first", "second"))
    for proc in (first, second):
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
    assert _builds(sources) == ["plain-kit", "slow-kit"], "each project's wheel is built once for both installs"
    for name in ("first", "second"):
        installed = sorted(p.name.split("-")[0] for p in (tmp_path / name).glob("*.dist-info"))
        assert installed == ["plain_kit", "slow_kit"], (name, installed)
    keys = sorted(p.name for p in cache.iterdir() if p.is_dir())
    assert len(keys) == 2 and not any(key.endswith(".partial") for key in keys), keys


def test_a_changed_source_is_built_again(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    project = _project(sources, "plain-kit", seconds=0)
    cache = tmp_path / "cache"
    for round_, value in enumerate(("1", "1", "2")):
        (project / "plain_kit.py").write_text(f"VALUE = {value}\n")
        proc = _install(cache, [project], tmp_path / f"target{round_}")
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        assert (tmp_path / f"target{round_}" / "plain_kit.py").read_text() == f"VALUE = {value}\n"
    assert _builds(sources) == ["plain-kit", "plain-kit"], "the same source reuses its wheel; a changed one builds"


def test_without_a_project_the_tool_says_how_to_call_it(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--target", "x"], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.startswith("usage: python tools/install_built_once.py CACHE_DIR"), (
        done.stderr
    )
