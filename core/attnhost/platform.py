"""Which accelerator platform this process runs on, told without importing torch.

Importing torch is slow and can initialise a device, and every CLI call and worker asks this first; torch's
``torch/version.py`` records its build flavour (``hip``, ``cuda``, ``xpu``), and ``torch_npu``'s presence suffices.
A build flavour says what torch *can* drive, not what this machine has: ``pip install torch`` gives a CUDA build on
a laptop without a GPU. So a CUDA or ROCm build counts only where the machine shows such a device, told as cheaply:
on Linux, the driver's device nodes (``/dev/nvidia*``, WSL's ``/dev/dxg``; ROCm's ``/dev/kfd``) and the visibility
variables (``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES``) set empty or ``-1``. Where
that cannot be told (another OS), the build decides. ``ATTNHOST_PLATFORM`` overrides all of it.
"""

from __future__ import annotations

import functools
import glob
import importlib.machinery
import importlib.util
import os
import re
import sys

from attnhost.errors import PlatformError, bounded
from attnhost.settings import PLATFORM_ENV, current

__all__ = ["KNOWN_PLATFORMS", "current_platform", "describe_detection", "detect_platform", "module_installed"]
__all__ += ["device_visible", "normalize_platform", "torch_build_info"]

KNOWN_PLATFORMS: tuple[str, ...] = ("cuda", "rocm", "xpu", "npu", "mps", "cpu")
TORCH_HINT = (
    "pip install 'attnhost[torch]' (on a CPU-only Linux machine first pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu, as a plain install brings a multi-GB CUDA build)"
)
_SPELLINGS = {"hip": "rocm", "amd": "rocm", "nvidia": "cuda", "ascend": "npu", "intel_xpu": "xpu"}
_DEVICE_NODES: dict[str, tuple[str, ...]] = {"cuda": ("dev/nvidia[0-9]*", "dev/dxg"), "rocm": ("dev/kfd",)}
"""Where each vendor's Linux driver shows a device: NVIDIA's per-GPU nodes (WSL's paravirtual GPU), AMD's compute
node."""
_VISIBILITY: dict[str, tuple[str, ...]] = {
    "cuda": ("CUDA_VISIBLE_DEVICES",),
    "rocm": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
}
_VENDOR = {"cuda": "NVIDIA", "rocm": "AMD"}
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


def device_visible(platform: str, root: str = "/") -> tuple[bool | None, str]:
    """Whether this machine shows a ``platform`` (``cuda`` or ``rocm``) device to this process, and what says so;
    ``None`` where the driver's device nodes cannot tell (another OS, another platform). ``root``: where ``dev/``
    is looked up."""
    nodes = _DEVICE_NODES.get(platform)
    if nodes is None or not sys.platform.startswith("linux"):
        return None, ""
    for variable in _VISIBILITY[platform]:
        value = os.environ.get(variable)
        if value is not None and value.strip() in ("", "-1"):
            return False, f"{variable}={value.strip()!r} hides every device"
    found = next((hit for pattern in nodes for hit in sorted(glob.glob(os.path.join(root, pattern)))), None)
    if found is None:
        return False, f"no {_VENDOR[platform]} device here (no {' or '.join('/' + n for n in nodes)})"
    return True, ""


def detect_platform() -> str:
    """Detect the platform from installed packages' build metadata and the machine's devices; never imports
    torch."""
    return _detection()[0]


@functools.lru_cache(maxsize=1)
def _detection() -> tuple[str, str]:
    """(platform, one line saying how it was decided)."""
    info = torch_build_info()
    source = f"detected from torch {info.get('__version__') or 'unknown version'} build metadata"
    if module_installed("torch_npu"):
        return "npu", source if info else "detected: torch_npu is installed"
    if not info:
        return "cpu", "detected: torch is not installed"
    for field, platform in (("hip", "rocm"), ("cuda", "cuda"), ("xpu", "xpu")):
        if info.get(field):
            visible, why = device_visible(platform)
            if visible is False:
                flavour = "ROCm" if platform == "rocm" else "CUDA"
                return "cpu", (
                    f"{source}: a {flavour} build, but {why}, so attention runs on the CPU; set "
                    f"{PLATFORM_ENV}={platform} to choose {platform} anyway"
                )
            return platform, source
    if sys.platform == "darwin" and os.uname().machine == "arm64":
        return "mps", source
    return "cpu", source


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
    return _detection()[1]
