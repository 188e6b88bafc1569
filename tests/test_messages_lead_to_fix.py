"""Messages that lead to the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers import make_plugin, run_cli

torch = pytest.importorskip("torch")  # the py312/py313 envs have no torch

import attnhost
from attnhost import BackendUnavailableError, ModelRunner, ServerArgs, resolve_draft_attention_backend
from attnhost.host import _reset_for_tests

DRAFT_PLUGIN = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    return [attnhost.BackendSpec(name="cpu_draft", factory=factory, platforms=("cpu",))]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["cpu_draft"]
"""


def test_a_fallback_that_cannot_run_here_is_marked_with_the_way_out() -> None:
    result = resolve_draft_attention_backend(ServerArgs(attention_backend="torch_native"), "cpu")
    assert result.name == "flashinfer" and result.fell_back and result.rejected == "torch_native"
    assert not result.available and result.problem is not None
    assert "'flashinfer' from plugin 'builtin' (distribution attnhost" in result.problem
    assert "because 'torch_native', inherited from the target's prefill backend, is not draft-capable" in result.problem
    assert "declared only" in result.problem
    assert "add_draft_attention_backend_choices(['torch_native'])" in result.problem
    assert "attnhost_draft_fallback hook" in result.problem
    assert "cannot run on cpu" in result.trace[-1]
    assert result == resolve_draft_attention_backend(ServerArgs(attention_backend="torch_native"), "cpu")
    fine = resolve_draft_attention_backend(ServerArgs(attention_backend="torch_native"), "cuda")
    assert fine.name == "flashinfer" and fine.available is False  # declared only everywhere without flashinfer
    _reset_for_tests()  # a new process: the way out the message names, taken before any ServerArgs
    attnhost.add_draft_attention_backend_choices(["torch_native"])
    assert resolve_draft_attention_backend(ServerArgs(attention_backend="torch_native"), "cpu").available


def test_the_way_out_names_an_available_draft_backend_when_a_plugin_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    make_plugin(site, "cpu-draft-attn", "1.0", "cpudraft", "cpu_draft_plugin_m2", DRAFT_PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    result = resolve_draft_attention_backend(ServerArgs(), "cpu")
    assert result.name == "flashinfer" and not result.fell_back and result.problem is not None
    assert "as no backend was named for target or draft" in result.problem
    assert "--speculative-draft-attention-backend (cpu_draft)" in result.problem


def test_the_draft_runner_says_it_is_a_fallback_from_the_named_backend_and_why() -> None:
    args = ServerArgs(attention_backend="torch_native")
    with pytest.raises(BackendUnavailableError) as caught:
        ModelRunner(args, is_draft=True, platform="cpu", num_layers=1)
    message = str(caught.value)
    assert message.startswith("draft runner: draft attention backend 'flashinfer' from plugin 'builtin'")
    assert "the draft fallback for cpu, because 'torch_native'" in message and "is not draft-capable" in message
    assert "cannot run on cpu: declared only" in message and "add_draft_attention_backend_choices" in message
    assert "\n" not in message


def test_a_runner_logs_which_backend_it_built_from_where_and_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="attnhost.runner")
    attnhost.add_draft_attention_backend_choices(["torch_native"])
    args = ServerArgs(attention_backend="torch_native")
    ModelRunner(args, platform="cpu", num_layers=1)
    ModelRunner(args, is_draft=True, platform="cpu", num_layers=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "attnhost.runner" and r.levelno == logging.INFO]
    assert len(lines) == 2
    target, draft = lines
    origin = "'torch_native' from plugin 'builtin' (distribution attnhost"
    assert target.startswith(f"target runner: built attention backend {origin}")
    assert "why: " in target and "target prefill: 'torch_native' (from --attention-backend)" in target
    assert draft.startswith(f"draft runner: built attention backend {origin}")
    assert "'torch_native' is draft-capable; using it" in draft


def test_an_allow_list_name_that_is_not_installed_gets_a_did_you_mean(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "alpha-attn", "1.0", "alpha", "alpha_plugin", "import attnhost\n")
    result = run_cli("plugins", "--json", path_entries=[site], env={"ATTNHOST_PLUGINS": "alpah"})
    lines = [line for line in result.stderr.splitlines() if "'alpah'" in line]
    assert len(lines) == 1
    assert "ATTNHOST_PLUGINS names plugin 'alpah', which is not installed; did you mean 'alpha'?" in lines[0]
    far = run_cli("plugins", "--json", path_entries=[site], env={"ATTNHOST_PLUGINS": "zzzz"})
    assert "check the spelling or install it" in far.stderr and "did you mean" not in far.stderr
