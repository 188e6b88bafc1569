"""A torchvision import shim for attnhost's SGLang test environment only (test scaffolding).

PyPI's torchvision wheel is a CUDA build that cannot be imported beside the CPU
``torch==2.13.0`` the tests use, yet SGLang 0.5.23 imports torchvision at
module level (``sglang.srt.configs`` pulls in image processors for vision
models). This package lets those imports succeed and nothing more: it defines
the few names SGLang evaluates at import time (``InterpolationMode``), and any
other use raises :class:`ImportError` naming the shim. A text-only model never
reaches image code, so nothing the tests check is computed here; if something
did reach it, it fails loudly instead of computing anything.

It is served only by the test kit's ``attnhost_sglang_cpu.shim.install()`` (see the
kit's README.md); attnhost does not ship or import it. It has no ``dist-info``, so
``importlib.metadata`` still reports torchvision as not installed.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["SHIM", "unavailable"]

#: Marker a test can check to tell the shim from a real torchvision.
SHIM = True


def unavailable(module: str, name: str) -> NoReturn:
    raise ImportError(
        f"{module}.{name} is not available: torchvision here is attnhost's SGLang test shim "
        "(the attnhost-sglang-cpu test kit), which only lets SGLang's module-level imports succeed; "
        "install a torchvision build matching torch to use image processing."
    )


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):
        raise AttributeError(name)
    unavailable(__name__, name)
