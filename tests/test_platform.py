"""Platform detection reads torch's build metadata and never imports torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from attnhost.errors import PlatformError
from attnhost.platform import KNOWN_PLATFORMS, normalize_platform

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
    site = _fake_torch(tmp_path / "site", **flavour)
    result = run_cli("list", "--json", path_entries=[site])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["platform"] == expected
    text = run_cli("list", path_entries=[site]).stdout
    assert f"platform {expected} (detected from torch 9.9.9+fake build metadata)" in text


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
