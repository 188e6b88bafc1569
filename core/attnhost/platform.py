"""Which accelerator platform this process runs on, told without importing torch.

Importing torch is slow and can initialise a device, and every CLI call and worker asks this first; torch's
``torch/version.py`` records its build flavour (``hip``, ``cuda``, ``xpu``), and ``torch_npu``'s presence suffices.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import re
import sys

from attnhost.errors import PlatformError, bounded
from attnhost.settings import PLATFORM_ENV, current

__all__ = ["KNOWN_PLATFORMS", "current_platform", "describe_detection", "detect_platform", "module_installed"]
__all__ += ["normalize_platform", "torch_build_info"]

KNOWN_PLATFORMS: tuple[str, ...] = ("cuda", "rocm", "xpu", "npu", "mps", "cpu")
TORCH_HINT = (
    "pip install 'attnhost[torch]' (on a CPU-only Linux machine first pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu, as a plain install brings a multi-GB CUDA build)"
)
_SPELLINGS = {"hip": "rocm", "amd": "rocm", "nvidia": "cuda", "ascend": "npu", "intel_xpu": "xpu"}
_VERSION_LINE = re.compile(r"^(__version__|hip|cuda|xpu)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def normalize_platform(name: str, *, origin: str = "") -> str:
    """Return the canonical lower-case platform name, or raise ``PlatformError`` with a suggestion."""
    key = name.strip().lower()
    key = _SPELLINGS.get(key, key)
    if key in KNOWN_PLATFORMS:
        return key
    import difflib  # only on this error path

    close = difflib.get_close_matches(key, KNOWN_PLATFORMS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = f" (from {origin})" if origin else ""
    raise PlatformError(
        f"unknown platform {bounded(repr(name))}{where}; {hint}choose from: {', '.join(KNOWN_PLATFORMS)}"
    )


@functools.lru_cache(maxsize=1)
def torch_build_info() -> dict[str, str | None]:
    """The literal fields of ``torch/version.py`` (``None`` for ``None``), read without running torch; ``{}``: none."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for location in (spec and spec.submodule_search_locations) or ():
        try:
            with open(os.path.join(location, "version.py"), encoding="utf-8") as handle:
                text = handle.read()
        except OSError:
            continue
        return {key: None if raw == "None" else raw.strip("'\"") for key, raw in _VERSION_LINE.findall(text)}
    return {}


def module_installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it or its packages: each part is looked up on its
    package's search path, as ``find_spec`` of a dotted name would import the packages (start-up must not)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
        for depth, part in enumerate(rest, 1):
            package = sys.modules.get(".".join([top, *rest[: depth - 1]]))
            path = getattr(package, "__path__", None) or (spec and spec.submodule_search_locations)
            spec = importlib.machinery.PathFinder.find_spec(part, list(path)) if path else None
        return spec is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def detect_platform() -> str:
    """Detect the platform from installed packages' build metadata; never imports torch."""
    if module_installed("torch_npu"):
        return "npu"
    info = torch_build_info()
    for field, platform in (("hip", "rocm"), ("cuda", "cuda"), ("xpu", "xpu")):
        if info.get(field):
            return platform
    if info and sys.platform == "darwin" and os.uname().machine == "arm64":
        return "mps"
    return "cpu"


def current_platform(override: str | None = None) -> str:
    """The platform in force: an explicit override (an empty one is an error, not "detect"), else
    ``ATTNHOST_PLATFORM`` (read once per process, so a plugin cannot move it), else detection."""
    if override is not None:
        return normalize_platform(override)
    if from_env := current().platform:
        return normalize_platform(from_env, origin=PLATFORM_ENV)
    return detect_platform()


def describe_detection() -> str:
    """One line saying where the platform came from, for ``attnhost list`` and traces."""
    if current().platform:
        return f"from {PLATFORM_ENV}"
    info = torch_build_info()
    if not info:
        return "detected: torch is not installed"
    version = info.get("__version__") or "unknown version"
    return f"detected from torch {version} build metadata"
