"""Install the test-only SGLang parts as real distributions on a temporary path (test scaffolding).

The out-of-tree CPU platform and the probe are SGLang plugins, so they are
installed the way pip would leave them (``*.dist-info`` with
``entry_points.txt``, written by tests/distgen.py) and found by SGLang's own
``importlib.metadata`` entry-point scan, never injected. The torchvision shim
is not a plugin and is not installed: the engine driver and the server
launcher install it per process (scaffolding/shim.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from distgen import make_dist

SCAFFOLDING = Path(__file__).resolve().parent / "scaffolding"
PLATFORM_NAME = "attnhost_test_cpu"
PROBE_ENV = "ATTNHOST_TEST_PROBE_FILE"


def install_test_plugins(site: Path) -> Path:
    """Write the platform and probe distributions into *site* (a directory to put on ``PYTHONPATH``)."""
    make_dist(
        site,
        "attnhost-test-cpu-platform",
        "0.0.0",
        {"sglang.srt.platforms": {PLATFORM_NAME: "attnhost_test_platform:activate"}},
        modules={"attnhost_test_platform": (SCAFFOLDING / "attnhost_test_platform.py").read_text()},
    )
    make_dist(
        site,
        "attnhost-test-probe",
        "0.0.0",
        {"sglang.srt.plugins": {"attnhost_test_probe": "attnhost_test_probe:register"}},
        modules={"attnhost_test_probe": (SCAFFOLDING / "attnhost_test_probe.py").read_text()},
    )
    return site


def sglang_env(site: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a real SGLang process runs in here: the test plugins on the path, the CPU platform
    selected, nothing downloaded, and no attnhost settings from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNHOST_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env.update(
        {
            "SGLANG_PLATFORM": PLATFORM_NAME,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env
