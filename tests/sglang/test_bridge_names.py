"""Engine names inside SGLang: one backend per name, overrides that do nothing say so,
a plugin's ``fa3`` follows the clash rule, and the rename warning is said once per engine start.

Each scenario is a fresh SGLang process (``probe_sglang.py``) with real plugin distributions on ``PYTHONPATH``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_probe
from distgen import make_dist

GROUP = "sglang.draft_attention_backends"
LITERAL = """
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    return [BackendSpec(name="attnhost_torch_native", factory=factory, description="named like the built-in's export")]
"""
FA3 = """
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    return [BackendSpec(name="fa3", factory=factory, requires=REQUIRES, description="a plugin's fa3")]
"""


def _warnings(report: dict[str, Any], level: str = "WARNING") -> list[str]:
    return [r["message"] for r in report["logs"] if r["level"] == level and r["logger"].startswith("attnhost")]


def _site(root: Path, module: str, source: str) -> Path:
    make_dist(root, f"{module.replace('_', '-')}", "1.0", {GROUP: {module: module}}, modules={module: source})
    return root


def test_two_backends_with_one_sglang_name_keep_the_first_and_warn_once(tmp_path: Path) -> None:
    site = _site(tmp_path, "literal_attn", LITERAL)
    report = run_probe({}, path_entries=[site])
    assert report["attnhost_factories"].count("attnhost_torch_native") == 1
    clash = [m for m in _warnings(report) if "both become SGLang backend 'attnhost_torch_native'" in m]
    assert len(clash) == 1, _warnings(report)
    assert (
        "'torch_native' (plugin 'builtin'" in clash[0] and "'attnhost_torch_native' (plugin 'literal_attn'" in clash[0]
    )
    registered = [m for m in _warnings(report, "INFO") if m.startswith("attnhost registered")]
    assert len(registered) == 1 and registered[0].count("attnhost_torch_native") == 1, registered
    assert "attnhost_torch_native as attnhost 'torch_native'" in registered[0]  # the built-in's: registered first


def test_strict_mode_makes_a_name_clash_an_error(tmp_path: Path) -> None:
    site = _site(tmp_path, "literal_attn", LITERAL)
    report = run_probe({}, path_entries=[site], env={"ATTNHOST_STRICT": "1"})
    assert report["attnhost_factories"] == []  # SGLang reports the plugin's error and goes on without it
    failed = [r["message"] for r in report["logs"] if r["message"].startswith("Failed to execute general plugin")]
    assert len(failed) == 1 and "[ATTNHOST_STRICT=1 and attnhost backends 'torch_native'" in failed[0], report["logs"]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("fa4", "which SGLang does not get: declared only"),
        ("triton", "which SGLang does not get: declared only"),
    ],
)
def test_an_override_that_does_nothing_says_why(value: str, why: str) -> None:
    report = run_probe({}, env={"ATTNHOST_SGLANG_OVERRIDE": value, "ATTNHOST_PLATFORM": "cpu"})
    lines = [m for m in _warnings(report) if m.startswith(f"ATTNHOST_SGLANG_OVERRIDE names {value!r}")]
    assert len(lines) == 1 and why in lines[0], _warnings(report)


def test_an_override_of_a_backend_that_cannot_run_here_gives_the_reason(tmp_path: Path) -> None:
    site = _site(
        tmp_path,
        "cuda_only_attn",
        FA3.replace("requires=REQUIRES", "platforms=('cuda',)").replace('"fa3"', '"cuda_only"'),
    )
    report = run_probe({}, path_entries=[site], env={"ATTNHOST_SGLANG_OVERRIDE": "cuda_only"})
    lines = [m for m in _warnings(report) if m.startswith("ATTNHOST_SGLANG_OVERRIDE names 'cuda_only'")]
    assert len(lines) == 1 and "runs on cuda, not cpu" in lines[0], _warnings(report)


def test_a_plugins_fa3_follows_the_clash_rule_or_says_why_not(tmp_path: Path) -> None:
    inherited = _site(tmp_path / "a", "fa3_attn", FA3.replace("requires=REQUIRES", "requires=()"))
    report = run_probe({}, path_entries=[inherited], env={"ATTNHOST_PLATFORM": "cuda"})
    assert "attnhost_fa3" not in report["attnhost_factories"]
    why = [m for m in _warnings(report, "INFO") if m.startswith("attnhost backend 'fa3'")]
    assert len(why) == 1 and "is not registered in SGLang: module 'sgl_kernel' is not installed" in why[0], why
    own = _site(tmp_path / "b", "fa3_attn", FA3.replace("requires=REQUIRES", "requires=('torch',)"))
    report = run_probe({}, path_entries=[own], env={"ATTNHOST_PLATFORM": "cuda"})
    assert "attnhost_fa3" in report["attnhost_factories"] and "fa3" not in report["attnhost_factories"]
    assert any("available in SGLang as 'attnhost_fa3'" in m for m in _warnings(report))


def test_the_rename_warning_is_said_once_per_engine_start_and_at_info_in_spawned_processes() -> None:
    report = run_probe({"spawn": True})
    renamed = "'torch_native' (plugin 'builtin') is available in SGLang as 'attnhost_torch_native'"
    assert len([m for m in _warnings(report) if renamed in m]) == 1
    child = report["spawned"]["logs"]
    assert [r["level"] for r in child if renamed in r["message"]] == ["INFO"], child
