"""Install a local project that compiles against torch, building its wheel once per source and torch.

``python tools/install_built_once.py CACHE PROJECT [PIP_INSTALL_OPTION ...]``: the tox environments that install
the compiled example (``examples/attnhost-cpukernels``) each have their own venv with the same torch, and the default
environment's ``tests/test_examples.py`` builds it too (installing it with ``--target`` into a folder of its own), so
each ``pip install --no-build-isolation`` compiled the same wheel again (ninja rebuilds everything: the include paths
differ per venv).
pip caches wheels built from an index, never from a local directory, and no tool at hand keys a build on a
directory's contents, so this one does: the wheel lands in ``CACHE/<key>/``, where the key hashes every source file
of the project (build outputs left out), the Python tag and the installed torch's version; a later environment with
the same key installs that wheel, passing pip the options given after PROJECT. Any change to a source file, to
Python or to torch builds afresh.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

SKIPPED_PARTS = {"build", "dist", "__pycache__", ".eggs"}
"""Directories whose contents are build outputs, not sources."""


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
    digest.update(f"{sys.implementation.cache_tag}\0torch {version('torch')}".encode())
    return digest.hexdigest()[:20]


def main(cache: Path, project: Path, install_options: list[str]) -> int:
    target = cache / source_key(project)
    wheels = sorted(target.glob("*.whl"))
    if not wheels:
        pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # what an interrupted build left
        built = subprocess.run([*pip, "--wheel-dir", str(partial), str(project)], check=False)
        if built.returncode != 0:
            return built.returncode
        partial.rename(target)  # only a finished build is ever found
        wheels = sorted(target.glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall"]
    return subprocess.run([*pip, *install_options, *map(str, wheels)], check=False).returncode


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python tools/install_built_once.py CACHE_DIR PROJECT_DIR [PIP_INSTALL_OPTION ...]")
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]).resolve(), sys.argv[3:]))
