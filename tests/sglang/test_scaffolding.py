"""The test-only parts stay test-only: attnhost ships none of them, and each does exactly its one job.

* attnhost's installed distribution contains and declares nothing of the
  scaffolding (no platform entry point, no probe, no torchvision shim); the
  scaffolding is the separate, installed distribution ``attnhost-sglang-cpu``,
  and the tiny HF models it builds with are ``attnhost-hf-models``, another
  test-only distribution that declares no entry points and pulls nothing in.
* The out-of-tree platform is chosen by SGLang's own platform discovery only
  when ``SGLANG_PLATFORM`` names it, and is then a CPU, out-of-tree platform
  with SGLang's default capabilities that allows speculative decoding.
* The kit's general plugins change nothing unless the test platform is
  selected: without it SGLang's tree kernels stay SGLang's.
* Without the shim, torchvision cannot be imported in this environment; with
  it, only the names SGLang reads at import time exist, anything else raises,
  and transformers still reports torchvision as not installed.
* The engine driver kept for many jobs (the engine kit's, one per session)
  replaces a driver that ended between jobs without blaming the next run.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from attnhost_sglang_cpu import PLATFORM_NAME, sglang_env
from attnhost_sglang_cpu.e2e import EngineDriver
from attnhost_sglang_cpu.procs import kill_group

KIT = "attnhost-sglang-cpu"
#: The test-only distribution of tiny HF models the kit builds with (shared with the vLLM engine kit).
HF_MODELS_KIT = "attnhost-hf-models"
SCAFFOLD_NAMES = (
    "attnhost_sglang_cpu",
    "attnhost_hf_models",
    "attnhost_test",
    "torchvision",
    "shim",
    "run_engine",
    "launch_server",
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = sglang_env(env)
    for name, value in env.items():
        if value == "":
            del full_env[name]
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=180, cwd=Path.home()
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
    assert not [r for r in dist.requires or [] if KIT in r or HF_MODELS_KIT in r]


def test_the_scaffolding_is_its_own_installed_distribution() -> None:
    kit = importlib.metadata.distribution(KIT)
    assert {(ep.group, ep.name, ep.value) for ep in kit.entry_points} == {
        ("sglang.srt.platforms", PLATFORM_NAME, "attnhost_sglang_cpu.platform:activate"),
        ("sglang.srt.plugins", "attnhost_test_cpu_kernels", "attnhost_sglang_cpu.plugin:register"),
        ("sglang.srt.plugins", "attnhost_test_probe", "attnhost_sglang_cpu.probe:register"),
        ("sglang.srt.plugins", "attnhost_test_dflash", "attnhost_sglang_cpu.dflash_plugin:register"),
        ("attnhost.engine_suites", "sglang", "attnhost_sglang_cpu.suite"),  # pytest --attnhost-engine sglang
    }
    assert "TEST-ONLY" in (kit.metadata["Summary"] or "")
    assert kit.requires in (None, [])  # installed --no-deps beside SGLang; it pulls nothing in
    # the only distribution in SGLang's platform group here
    platform_dists = {ep.dist.name for ep in importlib.metadata.entry_points(group="sglang.srt.platforms") if ep.dist}
    assert platform_dists == {KIT}


def test_the_tiny_hf_models_are_their_own_installed_distribution() -> None:
    kit = importlib.metadata.distribution(HF_MODELS_KIT)
    assert "TEST-ONLY" in (kit.metadata["Summary"] or "")
    assert kit.requires in (None, [])  # installed --no-deps beside the engine kit; it pulls nothing in
    assert not list(kit.entry_points)  # no platform, plugin or suite: only builders the kits import
    files = [str(f) for f in kit.files or []]
    assert any(f.startswith("attnhost_hf_models/") for f in files), files
    assert importlib.metadata.distribution(KIT).requires in (None, [])  # the SGLang kit does not declare it either


PLATFORM_PROBE = f"""
import json, os
from attnhost_sglang_cpu import shim
shim.install()
import sglang.srt.platforms as platforms
from sglang.srt.platforms.interface import PlatformCapabilities
unnamed = platforms._resolve_platform()  # SGLang's own discovery, with SGLANG_PLATFORM unset
os.environ["SGLANG_PLATFORM"] = {PLATFORM_NAME!r}
p = platforms._resolve_platform()  # what current_platform resolves to (the module may have resolved it already)
print(json.dumps({{"unnamed": type(unnamed).__module__, "cls": type(p).__module__ + "." + type(p).__qualname__,
                  "oot": p.is_out_of_tree(), "device": p.device_type,
                  "default_caps": p.capabilities == PlatformCapabilities(),
                  "spec": [p.supports_speculative_algorithm(a) for a in ("STANDALONE", "EAGLE", "NGRAM")],
                  "kv_pool": p.get_kv_pool_cls(kind="mha").__mro__[1].__name__,
                  "cache_locs": p.get_speculative_cache_locs_fn().__module__}}))
"""


def test_sglang_selects_the_test_platform_only_when_named() -> None:
    result = _python(PLATFORM_PROBE, SGLANG_PLATFORM="")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    # Not named: SGLang's auto-discovery asks the plugin, which declines (this machine gets one of SGLang's own).
    assert seen.pop("unnamed").startswith("sglang.srt.platforms")
    assert seen == {
        "cls": "attnhost_sglang_cpu.platform.AttnhostTestCpuPlatform",
        "oot": True,
        "device": "cpu",
        "default_caps": True,
        "spec": [True, True, False],
        "kv_pool": "MHATokenToKVPool",
        "cache_locs": "attnhost_sglang_cpu.spec_kernels",
    }


KERNELS_PROBE = """
import json
from attnhost_sglang_cpu import shim
shim.install()
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
hooks = {t: [[ht.name, h.__qualname__, src.plugin_name if src else None] for ht, h, src in hs]
         for t, hs in HookRegistry._hooks.items() if ".speculative.spec_tree." in t}
bound = {}
if hooks:
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative import eagle_utils
    for name in ("build_tree_kernel_efficient_func", "verify_tree_greedy_func"):
        fn = getattr(spec_tree, name)
        bound[name] = [fn is getattr(eagle_utils, name), fn.__wrapped__.__module__]
print(json.dumps({"hooks": hooks, "bound": bound}))
"""


@pytest.mark.parametrize("selected", [True, False], ids=["platform-selected", "platform-not-selected"])
def test_the_tree_kernel_stand_ins_replace_sglangs_only_on_the_test_platform(selected: bool) -> None:
    result = _python(KERNELS_PROBE, **({} if selected else {"SGLANG_PLATFORM": ""}))
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    if not selected:
        assert seen == {"hooks": {}, "bound": {}}
        return
    module = "sglang.kernels.ops.speculative.spec_tree"
    assert seen["hooks"] == {
        f"{module}.build_tree_kernel_efficient_func": [
            ["REPLACE", "attnhost_test_cpu_build_tree_kernel_efficient", "attnhost_test_cpu_kernels"]
        ],
        f"{module}.verify_tree_greedy_func": [
            ["REPLACE", "attnhost_test_cpu_verify_tree_greedy", "attnhost_test_cpu_kernels"]
        ],
    }
    # applied, and rebound in eagle_utils (which imported them by name)
    assert seen["bound"] == {
        name: [True, module] for name in ("build_tree_kernel_efficient_func", "verify_tree_greedy_func")
    }


SHIM_PROBE = """
import importlib, json
try:
    import torchvision
    before = "importable"
except ImportError:
    before = "absent"
from attnhost_sglang_cpu import shim
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


def test_torchvision_shim_is_minimal_and_loud() -> None:
    result = _python(SHIM_PROBE)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["before"] == "absent"  # the environment has no torchvision of its own
    assert seen["bicubic"] == "bicubic"
    assert seen["io"] == "absent"
    assert "attnhost's SGLang test shim" in seen["use"]
    assert seen["hf_sees_torchvision"] is False


def test_a_driver_that_ended_between_jobs_is_replaced_and_the_next_run_is_not_blamed(tmp_path: Path) -> None:
    """A crashed engine takes SGLang's driver down after the driver reported it: the next job, in the same
    ``EngineDriver``, gets a new driver and its own answer (here SGLang's refusal of a model directory that does
    not exist, which fails in the driver before any engine process starts), never "the engine driver died"."""
    missing = tmp_path / "no-such-model"
    run = {"name": "nowhere", "backend": "attnhost_torch_native"}
    with EngineDriver(sglang_env()) as driver:
        first, _ = driver.run(missing, [[1, 2, 3]], 2, [run], tmp_path)
        kill_group(first["nowhere"]["driver_pid"])  # as SGLang's process-tree kill after a scheduler's crash
        second, _ = driver.run(missing, [[1, 2, 3]], 2, [run], tmp_path)
    for result in (first["nowhere"], second["nowhere"]):
        assert "no-such-model" in result.get("error", ""), result
        assert "the engine driver died" not in result["error"], result["error"]
    assert second["nowhere"]["driver_pid"] != first["nowhere"]["driver_pid"]
    assert [ended.returncode for ended in driver.finished] == [-9, 0], driver.finished
    assert [ended.leftover for ended in driver.finished] == ["none", "none"]
