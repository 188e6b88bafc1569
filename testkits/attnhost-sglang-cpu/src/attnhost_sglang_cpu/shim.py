"""TEST-ONLY: install the torchvision import shim in this process.

SGLang 0.5.23 imports torchvision at module level, and PyPI's torchvision
cannot be imported beside the CPU torch the tests use. :func:`install` lets
``import torchvision...`` find the minimal package in this kit's
``_torchvision_shim/`` (see its docstring) through a ``sys.meta_path``
finder. The finder is per-process on purpose: unlike a ``sys.path`` entry it is not handed to
spawned children, so each process installs it itself (the launcher and the
engine driver do it at module level, which SGLang's spawned children
re-execute when they re-import ``__main__``).

Before the finder exists, transformers is asked (and caches) whether
torchvision is installed; it is not, so transformers keeps its torchvision-free
paths and never touches the shim.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

SHIM_DIR = Path(__file__).resolve().parent / "_torchvision_shim"


class _ShimFinder(importlib.abc.MetaPathFinder):
    """Serves ``torchvision`` and its submodules from :data:`SHIM_DIR`, nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        search = [str(SHIM_DIR)] if fullname == "torchvision" else path
        return importlib.machinery.PathFinder.find_spec(fullname, search)


def install() -> None:
    """Make ``import torchvision`` resolve to the shim in this process (idempotent)."""
    if any(isinstance(finder, _ShimFinder) for finder in sys.meta_path):
        return
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        raise RuntimeError(
            "a real torchvision is importable here; the attnhost SGLang test shim is not needed and would hide it"
        )
    sys.meta_path.insert(0, _ShimFinder())
