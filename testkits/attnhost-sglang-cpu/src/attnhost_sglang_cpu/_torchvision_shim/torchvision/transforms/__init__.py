"""Shim of ``torchvision.transforms``: only ``InterpolationMode`` and the ``functional`` submodule exist."""

from __future__ import annotations

from typing import NoReturn

from torchvision import unavailable
from torchvision.transforms import functional
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):
        raise AttributeError(name)
    unavailable(__name__, name)
