"""Shim of ``torchvision.transforms.functional``: only ``InterpolationMode``, with torchvision's members."""

from __future__ import annotations

import enum
from typing import NoReturn

from torchvision import unavailable

__all__ = ["InterpolationMode"]


class InterpolationMode(enum.Enum):
    """torchvision's interpolation modes (same names and values), referenced by SGLang at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):
        raise AttributeError(name)
    unavailable(__name__, name)
