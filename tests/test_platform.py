"""Platform detection reads torch's build metadata and never imports torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from attnhost.errors import PlatformError
from attnhost.platform import KNOWN_PLATFORMS, device_visible, normalize_platform

# A fake torch whose import would fail loudly: detection must read version.py, never import it.
EXPLODING_INIT = "raise RuntimeError('torch was imported during platform detection')\n"


def _fake_torch(root: Path, *, cuda: str = "None", hip: str = "None", xpu: str = "None", npu: bool = False) -> Path:
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(EXPLODING_INIT)
    (pkg / "version.py").write_text(
        "from typing import Optional\n\n"
        "__version__ = '9.9.9+fake'\n"
        f"cuda: Optional[str] = {cuda}\n"
        f"hip: Optional[str] = {hip}\n"
        f"xpu: Optional[str] = {xpu}\n"
    )
    if npu:
        (root / "torch_npu").mkdir()
        (root / "torch_npu" / "__init__.py").write_text(EXPLODING_INIT)
    return root


@pytest.mark.parametrize(
    ("flavour", "expected"),
    [
        ({"cuda": "'12.8'"}, "cuda"),
        ({"hip": "'6.4.1'"}, "rocm"),
        ({"xpu": "'20250101'"}, "xpu"),
        ({"npu": True}, "npu"),
        ({}, "cpu"),
    ],
)
def test_detects_from_build_metadata_without_importing_torch(tmp_path: Path, flavour: dict, expected: str) -> None:
    """A CUDA or ROCm build counts where this machine shows such a device; here, without one, attention runs on
    the CPU and ``attnhost list`` says why."""
    site = _fake_torch(tmp_path / "site", **flavour)
    visible, why = device_visible(expected)
    shown = "cpu" if visible is False else expected
    result = run_cli("list", "--json", path_entries=[site])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["platform"] == shown
    text = run_cli("list", "--wide", path_entries=[site]).stdout
    how = "detected from torch 9.9.9+fake build metadata"
    if visible is False:
        flavour_name = "ROCm" if expected == "rocm" else "CUDA"
        how += f": a {flavour_name} build, but {why}, so attention runs on the CPU; set ATTNHOST_PLATFORM={expected}"
    assert f"platform {shown} ({how}" in text, text


@pytest.mark.parametrize(
    ("platform", "nodes", "env", "expected"),
    [
        ("cuda", ["nvidia0", "nvidiactl"], {}, True),
        ("cuda", ["dxg"], {}, True),  # WSL's paravirtual GPU
        ("cuda", ["nvidiactl"], {}, False),  # the driver's control node alone: no GPU
        ("cuda", [], {}, False),
        ("cuda", ["nvidia0"], {"CUDA_VISIBLE_DEVICES": ""}, False),
        ("cuda", ["nvidia0"], {"CUDA_VISIBLE_DEVICES": "-1"}, False),
        ("cuda", ["nvidia0"], {"CUDA_VISIBLE_DEVICES": "1"}, True),
        ("rocm", ["kfd"], {}, True),
        ("rocm", [], {}, False),
        ("rocm", ["kfd"], {"HIP_VISIBLE_DEVICES": ""}, False),
        ("xpu", [], {}, None),  # no device node to tell by: the build decides
    ],
)
def test_a_device_is_told_by_the_drivers_nodes_and_visibility(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, platform: str, nodes: list[str], env: dict, expected: bool | None
) -> None:
    (tmp_path / "dev").mkdir()
    for node in nodes:
        (tmp_path / "dev" / node).touch()
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    visible, why = device_visible(platform, root=str(tmp_path))
    assert visible is expected
    assert bool(why) == (expected is False), why


def test_env_and_flag_override_detection(tmp_path: Path) -> None:
    site = _fake_torch(tmp_path / "site", cuda="'12.8'")
    assert (
        json.loads(run_cli("list", "--json", path_entries=[site], env={"ATTNHOST_PLATFORM": "rocm"}).stdout)["platform"]
        == "rocm"
    )
    assert json.loads(run_cli("list", "--json", "--platform", "xpu", path_entries=[site]).stdout)["platform"] == "xpu"


def test_platform_names() -> None:
    assert KNOWN_PLATFORMS == ("cuda", "rocm", "xpu", "npu", "mps", "cpu")
    assert normalize_platform("HIP") == "rocm" and normalize_platform(" Cuda ") == "cuda"
    with pytest.raises(PlatformError, match="did you mean 'rocm'"):
        normalize_platform("rocn")
