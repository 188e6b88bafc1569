"""Resolution: SGLang #35932's draft rule on every platform, plugins, hooks, and the ``resolve`` CLI."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from helpers import make_plugin, run_cli

import attnhost
from attnhost import BackendSpec, ServerArgs, resolve_attention_backends, resolve_draft_attention_backend
from attnhost.host import _reset_for_tests

PLATFORMS = ("cuda", "rocm", "cpu", "xpu", "npu", "mps")


def _fallback(platform: str) -> str:
    return "triton" if platform == "rocm" else "flashinfer"


# (case, args, expected draft or None for "the platform fallback", fell_back)
CASES = [
    ("explicit draft-capable", dict(speculative_draft_attention_backend="fa3"), "fa3", False),
    (
        "explicit draft-capable beats target",
        dict(attention_backend="torch_native", speculative_draft_attention_backend="triton"),
        "triton",
        False,
    ),
    ("explicit not draft-capable", dict(speculative_draft_attention_backend="flashmla"), None, True),
    ("explicit alias, not draft-capable", dict(speculative_draft_attention_backend="nsa"), None, True),
    ("inherited draft-capable", dict(attention_backend="flashinfer"), "flashinfer", False),
    ("inherited not draft-capable", dict(attention_backend="torch_native"), None, True),
    (
        "inherited from prefill flag",
        dict(prefill_attention_backend="fa4", decode_attention_backend="torch_native"),
        "fa4",
        False,
    ),
    (
        "prefill flag beats attention_backend",
        dict(attention_backend="fa3", prefill_attention_backend="aiter"),
        None,
        True,
    ),
    ("inherited alias", dict(attention_backend="tokenspeed_mla"), None, True),
    ("none at all", dict(), None, False),
    ("decode flag only is not inherited", dict(decode_attention_backend="fa3"), None, False),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(("case", "kwargs", "expected", "fell_back"), CASES, ids=[c[0] for c in CASES])
def test_draft_resolution_table(
    platform: str,
    case: str,
    kwargs: dict[str, str],
    expected: str | None,
    fell_back: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = ServerArgs(**kwargs)
    with caplog.at_level(logging.WARNING, logger="attnhost"):
        result = resolve_draft_attention_backend(args, platform=platform)
    assert result.name == (expected or _fallback(platform)), case
    assert result.fell_back is fell_back
    assert result.platform == platform
    assert result.trace and all(isinstance(step, str) and step for step in result.trace)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) is fell_back
    if fell_back:
        message = warnings[0].getMessage()
        rejected = args.speculative_draft_attention_backend or args.get_attention_backends()[0]
        assert repr(rejected) in message and repr(_fallback(platform)) in message
        assert "flashinfer, fa3, fa4, triton, ascend, trtllm_mha, intel_xpu" in message
        assert result.warning == message
        assert any("not draft-capable" in step for step in result.trace)
    with pytest.raises(AttributeError):
        result.name = "x"  # type: ignore[misc]


def test_platform_comes_from_env_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHOST_PLATFORM", "ROCm")
    assert resolve_draft_attention_backend(ServerArgs()).name == "triton"
    monkeypatch.setenv("ATTNHOST_PLATFORM", "gpu9000")
    assert resolve_draft_attention_backend(ServerArgs()).name == "triton", "the environment is read once per process"
    _reset_for_tests()  # a fresh process, as far as attnhost can tell
    with pytest.raises(attnhost.PlatformError, match="unknown platform 'gpu9000'"):
        resolve_draft_attention_backend(ServerArgs())


def test_server_args_normalises_and_rejects() -> None:
    args = ServerArgs(attention_backend="nsa", speculative_draft_attention_backend="compressed")
    assert args.attention_backend == "dsa" and args.speculative_draft_attention_backend == "dsv4"
    assert args.get_attention_backends() == ("dsa", "dsa")
    with pytest.raises(
        attnhost.UnknownBackendError, match="unknown attention backend 'flashinfr'; did you mean 'flashinfer'"
    ):
        ServerArgs(attention_backend="flashinfr")
    with pytest.raises(attnhost.UnknownBackendError, match="speculative_draft_attention_backend"):
        ServerArgs(speculative_draft_attention_backend="tritn")
    with pytest.raises(ValueError, match="speculative_attention_mode"):
        ServerArgs(speculative_attention_mode="verify")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        args.attention_backend = "triton"  # type: ignore[misc]


def test_target_resolution_uses_flags_then_platform_default() -> None:
    split = resolve_attention_backends(
        ServerArgs(prefill_attention_backend="fa3", decode_attention_backend="flashinfer"), "cuda"
    )
    assert (split.prefill, split.decode) == ("fa3", "flashinfer")
    default = resolve_attention_backends(ServerArgs(), "cpu")
    assert (default.prefill, default.decode) == ("torch_native", "torch_native")
    assert "attnhost_default_attention_backend" in default.trace[0]
    half = resolve_attention_backends(ServerArgs(decode_attention_backend="triton"), "rocm")
    assert (half.prefill, half.decode) == ("aiter", "triton")


class _CpuDraftPlatform:
    """A platform plugin answering the draft fallback for cpu (as SGLang special-cased XPU in code)."""

    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(name="vendor_draft", factory="x:y", platforms=("cpu",)),
            BackendSpec(name="vendor_target_only", factory="x:y"),
        ]

    @attnhost.hookimpl
    def attnhost_draft_attention_backends(self) -> list[str]:
        return ["vendor_draft"]

    @attnhost.hookimpl
    def attnhost_draft_fallback(self, platform: str) -> str | None:
        return "vendor_draft" if platform == "cpu" else None


def test_plugin_backends_and_fallback_hook() -> None:
    attnhost.register_plugin(_CpuDraftPlatform(), name="vendor")
    accepted = resolve_draft_attention_backend(ServerArgs(speculative_draft_attention_backend="vendor_draft"), "cuda")
    assert accepted.name == "vendor_draft" and not accepted.fell_back
    rejected = resolve_draft_attention_backend(ServerArgs(attention_backend="vendor_target_only"), "cuda")
    assert rejected.name == "flashinfer" and rejected.fell_back
    on_cpu = resolve_draft_attention_backend(ServerArgs(attention_backend="vendor_target_only"), "cpu")
    assert on_cpu.name == "vendor_draft" and on_cpu.fell_back
    assert "plugin 'vendor'" in on_cpu.trace[-2]
    on_rocm = resolve_draft_attention_backend(ServerArgs(), "rocm")
    assert on_rocm.name == "triton" and "plugin 'builtin'" in on_rocm.trace[-2]
    assert not on_rocm.available and "cannot run on rocm" in on_rocm.trace[-1]  # triton is declared only here


def test_draft_capability_has_one_source_of_truth() -> None:
    attnhost.add_draft_attention_backend_choices(["torch_native"])
    result = resolve_draft_attention_backend(ServerArgs(attention_backend="torch_native"), "cpu")
    assert result.name == "torch_native" and not result.fell_back
    assert "torch_native" in attnhost.DRAFT_ATTENTION_BACKEND_CHOICES


def test_broken_fallback_hook_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        @attnhost.hookimpl(tryfirst=True)
        def attnhost_draft_fallback(self, platform: str) -> str:
            raise RuntimeError("boom")

    class Wrong:
        @attnhost.hookimpl
        def attnhost_draft_fallback(self, platform: str) -> str:
            return "torch_native"  # not draft-capable

    attnhost.register_plugin(Broken(), name="broken")
    attnhost.register_plugin(Wrong(), name="wrong")
    with caplog.at_level(logging.WARNING, logger="attnhost"):
        result = resolve_draft_attention_backend(ServerArgs(), "cuda")
    assert result.name == "flashinfer"
    text = caplog.text
    assert "plugin 'broken'" in text and "RuntimeError: boom" in text
    assert "plugin 'wrong'" in text and "not draft-capable" in text


# -- CLI -------------------------------------------------------------------------------------


@pytest.mark.torch  # torch_native is available only with torch
def test_cli_resolve_explains_rocm_fallback() -> None:
    result = run_cli("resolve", "--attention-backend", "torch_native", "--platform", "rocm", "--wide")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^prefill +torch_native *$", out, re.M) and re.search(r"^decode +torch_native *$", out, re.M)
    assert re.search(r"^draft +triton +\(fell back\)", out, re.M)
    assert "'torch_native' is not draft-capable" in out and "falling back to 'triton'" in out
    # the warning is printed once, in the report's warnings (not a second time as a log line on stderr)
    warning = "draft worker only supports attention backends in ["
    assert (out + result.stderr).count(warning) == 1, out + result.stderr
    assert re.search(r"^warnings:\n  - draft worker only supports .* but got 'torch_native'", out, re.M)


def test_cli_resolve_json() -> None:
    result = run_cli("resolve", "--attention-backend", "torch_native", "--platform", "rocm", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {"platform", "prefill", "decode", "draft", "draft_fell_back", "trace", "warnings"} <= set(data)
    assert data["platform"] == "rocm" and data["draft"] == "triton" and data["draft_fell_back"] is True
    assert data["prefill"] == data["decode"] == "torch_native"
    # two warnings: SGLang's fallback one, and that the fallback (triton, declared only) cannot run here
    assert len(data["warnings"]) == 2 and len(data["trace"]) >= 4
    assert data["draft_available"] is False and data["draft_problem"] == data["warnings"][1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--attention-backend", "flashinfr"], "unknown attention backend 'flashinfr'; did you mean 'flashinfer'?"),
        (
            ["--speculative-draft-attention-backend", "tritn"],
            "unknown attention backend 'tritn'; did you mean 'triton'?",
        ),
        (["--decode-attention-backend", "zzzz"], "unknown attention backend 'zzzz'; choose from: triton"),
        (["--platform", "cudaa"], "unknown platform 'cudaa'; did you mean 'cuda'?"),
        (["--speculative-attention-mode", "verify"], "invalid choice: 'verify'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv: list[str], message: str) -> None:
    result = run_cli("resolve", *argv)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_bad_platform_env_is_one_line_exit_2() -> None:
    result = run_cli("list", env={"ATTNHOST_PLATFORM": "quantum"})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "attnhost: error: unknown platform 'quantum' (from ATTNHOST_PLATFORM); "
        "choose from: cuda, rocm, xpu, npu, mps, cpu"
    )


def test_cli_help_lists_plugin_backends(tmp_path: Path) -> None:
    site = tmp_path / "site"
    source = (
        "import attnhost\n@attnhost.hookimpl\ndef attnhost_attention_backends():\n"
        "    return [attnhost.BackendSpec(name='zeta_attention')]\n"
    )
    make_plugin(site, "zeta", "1.0", "zeta", "zeta_plugin", source)
    result = run_cli("resolve", "--help", path_entries=[site])
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())
    assert "zeta_attention" in help_text and "torch_native" in help_text
    for flag in (
        "--attention-backend",
        "--prefill-attention-backend",
        "--decode-attention-backend",
        "--speculative-draft-attention-backend",
        "--speculative-attention-mode",
    ):
        assert flag in help_text


def test_add_cli_args_in_a_users_parser() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--attention-backend", "nsa", "--speculative-attention-mode", "decode"])
    args = ServerArgs.from_cli_args(ns)
    assert args.attention_backend == "dsa" and args.speculative_attention_mode == "decode"
    assert args.get_attention_backends() == ("dsa", "dsa")
