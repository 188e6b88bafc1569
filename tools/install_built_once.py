"""Install local projects from wheels built once per source, Python and torch, whichever environment builds first.

``python tools/install_built_once.py CACHE PROJECT [PROJECT ...] [PIP_INSTALL_OPTION ...]``: the tox environments
install the same local projects (the examples, the test-only kits) into venvs of their own, and the compiled example
(``examples/attnhost-cpukernels``) compiles against torch, which the default environment's ``tests/test_examples.py``
does too (installing it with ``--target`` into a folder of its own); each ``pip install`` of a directory built it
again (ninja rebuilds everything: the include paths differ per venv), and ``tox p`` runs two environments at once,
whose builds of one directory would share its ``build/`` folder.
pip caches wheels built from an index, never from a local directory, and no tool at hand keys a build on a
directory's contents, so this one does: each project's wheel lands in ``CACHE/<key>/``, where the key hashes every
source file of the project (build outputs left out), the Python tag and the installed torch's version; a later
environment with the same key installs that wheel. A build holds a lock on its key (``filelock``, which pip and tox
use too), so an environment that wants a wheel another is building waits for it and installs it. The options given
after the projects go to ``pip install``. Any change to a source file, to Python or to torch builds afresh.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from filelock import FileLock

SKIPPED_PARTS = {"build", "dist", "__pycache__", ".eggs"}
"""Directories whose contents are build outputs, not sources."""


def _torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def source_key(project: Path) -> str:
    """A digest of every source file under ``project`` (paths and bytes), Python's tag and torch's version."""
    digest = hashlib.sha256()
    for path in sorted(project.rglob("*")):
        relative = path.relative_to(project)
        if not path.is_file() or SKIPPED_PARTS & set(relative.parts) or path.suffix in (".so", ".pyd", ".pyc"):
            continue
        if any(part.endswith(".egg-info") for part in relative.parts):
            continue
        digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{sys.implementation.cache_tag}\0torch {_torch_version()}".encode())
    return digest.hexdigest()[:20]


def built_wheel(cache: Path, project: Path) -> list[Path]:
    """The wheel of *project* in *cache*, built now unless an earlier build left it (pip's failure raises
    :class:`subprocess.CalledProcessError`)."""
    target = cache / source_key(project)
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not any(target.glob("*.whl")):
            pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)  # what an interrupted build left
            subprocess.run([*pip, "--wheel-dir", str(partial), str(project)], check=True)
            partial.rename(target)  # only a finished build is ever found
        return sorted(target.glob("*.whl"))


def main(cache: Path, projects: list[Path], install_options: list[str]) -> int:
    try:
        wheels = [wheel for project in projects for wheel in built_wheel(cache, project)]
    except subprocess.CalledProcessError as failed:
        return failed.returncode
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall"]
    return subprocess.run([*pip, *install_options, *map(str, wheels)], check=False).returncode


if __name__ == "__main__":
    arguments = sys.argv[2:]
    count = next((i for i, argument in enumerate(arguments) if argument.startswith("-")), len(arguments))
    if len(sys.argv) < 2 or count == 0:
        sys.exit("usage: python tools/install_built_once.py CACHE_DIR PROJECT_DIR [PROJECT_DIR ...] [PIP_OPTION ...]")
    projects = [Path(argument).resolve() for argument in arguments[:count]]
    sys.exit(main(Path(sys.argv[1]), projects, arguments[count:]))
