"""Registration through vLLM's own plugin loader: names, clashes, declared-only names and the env controls.

The in-process checks use the test process's own ``load_general_plugins()``
(conftest). The rest need another environment per vLLM process, so each
runs ``scenarios.py`` in its own interpreter; they start together and run
concurrently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distgen import make_dist
from helpers import subprocess_env
from scenarios import CLASH_PLUGIN
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from attnhost.engines.vllm import bridge
from attnhost.engines.vllm.bridge import ClassPath
from attnhost.versions import TESTED

SCENARIOS: dict[str, dict[str, str]] = {
    "clash": {},
    "override": {"ATTNHOST_VLLM_OVERRIDE": "flex_attention"},
    "attnhost_plugins": {"ATTNHOST_PLUGINS": "builtin"},
    "vllm_plugins": {"VLLM_PLUGINS": "some_other_plugin"},
}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    plugin_root = Path(tmp_path_factory.mktemp("acme-flex"))
    make_dist(
        plugin_root,
        "acme-flex",
        "1.0",
        {"sglang.draft_attention_backends": {"acme_flex": "acme_flex"}},
        modules=CLASH_PLUGIN,
    )
    script = Path(__file__).with_name("scenarios.py")
    running = {}
    for name, env in SCENARIOS.items():
        paths = [plugin_root] if name in ("clash", "override") else []
        running[name] = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(paths, {"VLLM_TARGET_DEVICE": "cpu", **env}),
        )
    results = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("RESULT: ")]
        assert process.returncode == 0 and lines, f"scenario {name} failed:\n{err[-3000:]}"
        results[name] = json.loads(lines[-1].removeprefix("RESULT: "))
    yield results


def test_every_implemented_backend_is_a_vllm_backend_with_its_own_class() -> None:
    classes = {}
    for name, attnhost_name in (
        ("TORCH_NATIVE", "torch_native"),
        ("TINY", "tiny"),
        ("BATCHED_MATMUL", "batched_matmul"),
    ):
        member = AttentionBackendEnum[name]
        assert isinstance(member.value, ClassPath) and member.value == f"attnhost.engines.vllm.backends.{name}"
        cls = member.get_class()
        assert cls.get_name() == name and cls.identity.attnhost_name == attnhost_name
        classes[name] = cls
    assert len({id(cls) for cls in classes.values()}) == 3
    assert set(bridge.exported()) >= {"TORCH_NATIVE", "TINY", "BATCHED_MATMUL"}


def test_vllm_parser_takes_the_names(tiny_model: str) -> None:
    """`vllm serve --attention-backend torch_native`: vLLM's own parser and EngineArgs, then its enum lookup."""
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = AsyncEngineArgs.from_cli_args(
        parser.parse_args(["--model", tiny_model, "--attention-backend", "batched_matmul"])
    )
    assert args.attention_backend == "batched_matmul"
    assert AttentionBackendEnum[args.attention_backend.upper()].get_class().identity.attnhost_name == "batched_matmul"


def test_declared_only_names_add_nothing() -> None:
    members = AttentionBackendEnum.__members__
    assert "FA3" not in members and "TRITON" not in members and "ATTNHOST_FLASHINFER" not in members
    assert not isinstance(members["FLASHINFER"].value, ClassPath)  # vLLM's own, untouched
    assert not isinstance(members["FLEX_ATTENTION"].value, ClassPath)


def test_clash_keeps_vllms_backend_and_renames_ours(scenarios: dict[str, dict[str, Any]]) -> None:
    result = scenarios["clash"]
    assert result["paths"]["FLEX_ATTENTION"] == "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"
    assert result["paths"]["ATTNHOST_FLEX_ATTENTION"] == "attnhost.engines.vllm.backends.ATTNHOST_FLEX_ATTENTION"
    assert result["registered"] == [
        "ATTNHOST_FLEX_ATTENTION",
        "BATCHED_MATMUL",
        "BATCHED_MATMUL_MLA",
        "CPU_PAGED",
        "TINY",
        "TORCH_NATIVE",
        "TORCH_NATIVE_MLA",
    ]
    warnings = [message for level, message in result["log"] if level == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "'flex_attention'" in warnings[0] and "'ATTNHOST_FLEX_ATTENTION'" in warnings[0]
    assert "ATTNHOST_VLLM_OVERRIDE=flex_attention" in warnings[0]
    infos = [message for level, message in result["log"] if level == "INFO"]
    assert len(infos) == 1 and "ATTNHOST_FLEX_ATTENTION as attnhost 'flex_attention'" in infos[0], infos
    assert result["has"] == {
        "FA3": False,
        "ATTNHOST_FLASHINFER": False,
        "FLASHINFER": True,
        "ATTNHOST_TORCH_NATIVE": False,
    }


def test_capabilities_become_vllms_supported_dtypes_and_head_sizes(scenarios: dict[str, dict[str, Any]]) -> None:
    adapter = scenarios["clash"]["adapter"]
    assert adapter["selected"] == "ATTNHOST_FLEX_ATTENTION"  # AttentionConfig(backend="attnhost_flex_attention")
    assert adapter["attnhost_name"] == "flex_attention"
    assert adapter["dtypes"] == ["torch.float16", "torch.bfloat16"]
    assert adapter["kv_dtypes"] == ["auto", "float16", "bfloat16"]
    assert adapter["head_sizes"] == [64, 128]
    assert adapter["ok"] == []
    assert any("head_size not supported" in reason for reason in adapter["bad"])
    assert any("dtype not supported" in reason for reason in adapter["bad"])
    assert all("attnhost backend 'flex_attention' (plugin 'acme_flex'" in reason for reason in adapter["bad"])


def test_opt_in_override_replaces_vllms_backend(scenarios: dict[str, dict[str, Any]]) -> None:
    result = scenarios["override"]
    assert result["paths"]["FLEX_ATTENTION"] == "attnhost.engines.vllm.backends.FLEX_ATTENTION"
    assert result["registered"] == [
        "BATCHED_MATMUL",
        "BATCHED_MATMUL_MLA",
        "CPU_PAGED",
        "FLEX_ATTENTION",
        "TINY",
        "TORCH_NATIVE",
        "TORCH_NATIVE_MLA",
    ]
    assert result["adapter"]["attnhost_name"] == "flex_attention"
    warnings = [message for level, message in result["log"] if level == "WARNING"]
    assert len(warnings) == 1 and "replaces vLLM's own 'FLEX_ATTENTION'" in warnings[0], warnings


def test_attnhost_plugins_allow_list_applies(scenarios: dict[str, dict[str, Any]]) -> None:
    result = scenarios["attnhost_plugins"]
    assert result["registered"] == ["TORCH_NATIVE", "TORCH_NATIVE_MLA"]  # its MLA name comes with it


def test_vllm_plugins_allow_list_applies(scenarios: dict[str, dict[str, Any]]) -> None:
    result = scenarios["vllm_plugins"]
    assert result["registered"] == [] and result["attnhost_imported"] is False


def test_a_vllm_outside_the_tested_versions_gets_one_warning_when_it_loads_attnhost(tmp_path: Path) -> None:
    """vLLM's plugin loader runs attnhost's entry point, which says once that this vLLM (here a distribution
    claiming 0.40.0, ahead of the real one on the path) is outside ``attnhost.versions.TESTED``."""
    make_dist(tmp_path, "vllm", "0.40.0")
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(name)s %(levelname)s %(message)s')\n"
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env([tmp_path]), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "outside the versions attnhost is tested with" in line]
    assert lines == [
        "attnhost.versions WARNING vLLM 0.40.0 (distribution vllm) is outside the versions attnhost is tested with "
        f"(vllm {TESTED['vllm']}); attnhost runs, but if a backend misbehaves, say which versions in the report "
        "(`attnhost versions` lists them)"
    ], done.stdout[-3000:]
