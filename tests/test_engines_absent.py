"""Without vLLM installed, attnhost's vLLM bridge is declared and inert: nothing of vLLM is imported.

Runs in the default test environment, which has no vLLM; in an environment
that has it, the ``vllm`` tox environment's tests cover the rest. Each check
is a fresh interpreter, so ``sys.modules`` shows exactly what was imported.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from helpers import run_cli, run_python


def _vllm_installed() -> bool:
    # the distribution, not find_spec: with tests/ on sys.path, tests/vllm/ looks like a namespace package "vllm"
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed here")

PROBE = """
import json, sys
from importlib.metadata import entry_points
import attnhost
from attnhost import ServerArgs
eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "attnhost"]
register = eps[0].load()
args = ServerArgs(attention_backend="torch_native")
try:
    register()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
else:
    error = None
print(json.dumps({
    "entry_point": eps[0].value,
    "error": error,
    "vllm": sorted(name for name in sys.modules if name == "vllm" or name.startswith("vllm.")),
    "torch": "torch" in sys.modules,
}))
"""


def test_entry_point_is_declared_and_imports_nothing_of_vllm() -> None:
    result = run_python(PROBE)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["entry_point"] == "attnhost.engines.vllm:register"
    assert data["vllm"] == [] and data["torch"] is False
    assert data["error"].startswith("BackendUnavailableError: attnhost.engines.vllm.register() is vLLM's plugin hook")
    assert "vLLM is not installed" in data["error"]


def test_cli_works_without_vllm() -> None:
    result = run_cli("list", "--json")
    assert result.returncode == 0, result.stderr
    names = {backend["name"] for backend in json.loads(result.stdout)["backends"]}
    assert "torch_native" in names
