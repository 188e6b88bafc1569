"""TEST SCAFFOLDING ONLY — a stand-in for ``torchvision`` in the ``sglang`` tox environment.

PyPI's torchvision wheel is a CUDA build that cannot be imported beside the
CPU torch this machine uses, yet ``sglang.srt.configs`` (and transformers'
image utilities) import it at module level. Nothing on the attention or
text-generation path calls it, so this package answers every
``torchvision.*`` import with a module whose attributes exist but raise
when *used*: a test that strays onto an image path fails loudly instead of
computing anything. attnhost itself never imports torchvision; this
directory is put on ``PYTHONPATH`` by ``tests/sglang/conftest.py`` only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+attnhost.test.shim"


class _Unavailable:
    """Any torchvision object: attribute access works, calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} was called, but torchvision is a test shim in attnhost's sglang tests")

    def __mro_entries__(self, bases: tuple[type, ...]) -> tuple[type, ...]:
        return (object,)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Provides ``torchvision.<anything>`` as a module of :class:`_Unavailable` attributes."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr, _name=spec.name: _Unavailable(f"{_name}.{attr}")  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _SubmoduleFinder())


def __getattr__(name: str) -> _Unavailable:
    return _Unavailable(f"torchvision.{name}")
