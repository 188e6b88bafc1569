"""The test-only parts stay test-only: attnhost ships none of them, and each does exactly its one job (issue 16).

* attnhost's installed distribution contains and declares nothing of the
  scaffolding (no platform entry point, no probe, no torchvision shim).
* The out-of-tree platform is chosen by SGLang's own platform discovery only
  when ``SGLANG_PLATFORM`` names it, and is then a CPU, out-of-tree platform
  with SGLang's default capabilities.
* Without the shim, torchvision cannot be imported in this environment; with
  it, only the names SGLang reads at import time exist, anything else raises,
  and transformers still reports torchvision as not installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from sgl_scaffold import PLATFORM_NAME, SCAFFOLDING, sglang_env

SCAFFOLD_NAMES = ("attnhost_test_platform", "attnhost_test_probe", "torchvision", "shim", "run_engine", "launch_server")


def _python(code: str, site: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = sglang_env(site, env)
    for name, value in env.items():
        if value == "":
            del full_env[name]
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=180, cwd=SCAFFOLDING
    )


def test_attnhost_ships_no_scaffolding() -> None:
    # The installed wheel (an in-tree build's attnhost.egg-info in the working directory lists sdist sources).
    site = sysconfig.get_paths()["purelib"]
    (dist,) = (d for d in importlib.metadata.distributions(path=[site]) if d.metadata["Name"] == "attnhost")
    files = [str(f) for f in dist.files or []]
    assert files, "attnhost's installed files are not listed"
    assert not [f for f in files if any(name in f for name in SCAFFOLD_NAMES) or f.startswith("tests/")]
    groups = {ep.group for ep in dist.entry_points}
    assert "sglang.srt.platforms" not in groups
    assert [ep.value for ep in dist.entry_points if ep.group == "sglang.srt.plugins"] == [
        "attnhost.engines.sglang:register"
    ]
    assert not [r for r in dist.requires or [] if r.split()[0].lower() in ("torchvision", "sglang", "transformers")]


PLATFORM_PROBE = f"""
import json, os
import sglang.srt.platforms as platforms
from sglang.srt.platforms.interface import PlatformCapabilities
unnamed = platforms._resolve_platform()  # SGLang's own discovery, with SGLANG_PLATFORM unset
os.environ["SGLANG_PLATFORM"] = {PLATFORM_NAME!r}
p = platforms._resolve_platform()  # what current_platform resolves to (the module may have resolved it already)
print(json.dumps({{"unnamed": type(unnamed).__module__, "cls": type(p).__module__ + "." + type(p).__qualname__,
                  "oot": p.is_out_of_tree(), "device": p.device_type,
                  "default_caps": p.capabilities == PlatformCapabilities()}}))
"""


def test_sglang_selects_the_test_platform_only_when_named(sglang_site: Path) -> None:
    result = _python(PLATFORM_PROBE, sglang_site, SGLANG_PLATFORM="")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    # Not named: SGLang's auto-discovery asks the plugin, which declines (this machine gets one of SGLang's own).
    assert seen.pop("unnamed").startswith("sglang.srt.platforms")
    assert seen == {
        "cls": "attnhost_test_platform.AttnhostTestCpuPlatform",
        "oot": True,
        "device": "cpu",
        "default_caps": True,
    }
    installed = importlib.metadata.distributions(path=[str(sglang_site)])
    assert {(ep.group, ep.name) for dist in installed for ep in dist.entry_points} == {
        ("sglang.srt.platforms", PLATFORM_NAME),
        ("sglang.srt.plugins", "attnhost_test_probe"),
    }


SHIM_PROBE = """
import importlib, json
try:
    import torchvision
    before = "importable"
except ImportError:
    before = "absent"
import shim
shim.install()
from torchvision.transforms import InterpolationMode, functional
from transformers.utils import import_utils
try:
    importlib.import_module("torchvision.io")
    io = "importable"
except ImportError:
    io = "absent"
try:
    functional.resize
    use = "ran"
except ImportError as err:
    use = str(err)
print(json.dumps({"before": before, "bicubic": InterpolationMode.BICUBIC.value, "io": io, "use": use,
                  "hf_sees_torchvision": import_utils.is_torchvision_available()}))
"""


def test_torchvision_shim_is_minimal_and_loud(sglang_site: Path) -> None:
    result = _python(SHIM_PROBE, sglang_site)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["before"] == "absent"  # the environment has no torchvision of its own
    assert seen["bicubic"] == "bicubic"
    assert seen["io"] == "absent"
    assert "attnhost's SGLang test shim" in seen["use"]
    assert seen["hf_sees_torchvision"] is False
