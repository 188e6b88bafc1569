"""Saying why not, to a plugin author: every command tells what the kit would.

The plugins are real installed distributions (``distgen``) and the CLI runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import GROUP, make_plugin, plugin_guide, run_cli, run_python

ACME_HOOKS = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return [attnhost.BackendSpec(name="acme", factory="acme_attn.kernel:AcmeAttnBackend", description="ACME")]
"""

FALLBACK_HOOKS = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    return [attnhost.BackendSpec(name="cpu_draft", factory=factory, description="torch_native for drafts")]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["cpu_draft"]

@attnhost.hookimpl
def attnhost_draft_fallback(platform):
    return "cpu_draft" if platform == "cpu" else None
"""

NODOC = """
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class NoDocstring(TorchNativeAttnBackend):
    pass
"""

MISSING = "factory module 'acme_attn.kernel' not found"


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``acme-attn`` as the guide's author wrote it, but with the factory pointing at a module that is not there."""
    site = tmp_path_factory.mktemp("acme-site")
    make_plugin(site, "acme-attn", "1.0", "acme", "acme_attn", ACME_HOOKS)
    return site


def test_a_factory_module_that_is_not_there_is_unavailable_in_every_command(acme_site: Path) -> None:
    data = json.loads(run_cli("list", "--json", path_entries=[acme_site]).stdout)
    row = next(row for row in data["backends"] if row["name"] == "acme")
    assert row["available"] is False and row["reason"].startswith(MISSING), row
    table = run_cli("list", "--wide", path_entries=[acme_site]).stdout
    assert re.search(rf"acme .* no: {re.escape(MISSING)}", table), table
    one = run_cli("list", "acme", "--platform", "cuda", path_entries=[acme_site])
    assert re.search(rf"on cuda\s+no: {re.escape(MISSING)}", one.stdout), one.stdout + one.stderr
    resolved = run_cli("resolve", "--attention-backend", "acme", "--json", path_entries=[acme_site])
    assert json.loads(resolved.stdout)["availability"]["prefill"]["reason"].startswith(MISSING)
    plugins = run_cli("plugins", path_entries=[acme_site]).stdout
    assert f"warning: backend 'acme': {MISSING}" in plugins, plugins


def test_an_importable_factory_module_in_a_subpackage_is_available(tmp_path: Path) -> None:
    hooks = ACME_HOOKS.replace('description="ACME"', 'description="ACME", platforms=("cpu",)')
    make_dist(
        tmp_path,
        "acme-attn",
        "1.0",
        {GROUP: {"acme": "acme_attn"}},
        modules={"acme_attn": hooks, "acme_attn.kernel": "raise RuntimeError('imported by the availability check')"},
    )
    row = json.loads(run_cli("list", "acme", "--json", "--platform", "cpu", path_entries=[tmp_path]).stdout)
    assert row["backend"]["available"] is True, row  # found, never imported (importing it raises)


def test_unknown_name_of_a_plugin_that_failed_to_load_names_that_plugin(tmp_path: Path) -> None:
    make_plugin(tmp_path, "acme-attn", "1.0", "acme", "acme_attn", "raise ImportError('no module named acme_kernels')")
    result = run_cli("list", "acme", path_entries=[tmp_path])
    assert result.returncode == 2
    assert "did you mean" not in result.stderr, result.stderr
    assert "plugin 'acme' (distribution acme-attn 1.0), which would likely provide it, failed to load" in result.stderr
    assert "no module named acme_kernels" in result.stderr and result.stderr.count("\n") >= 1
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr


MISSPELLED_HOOK = "import attnhost\n\n@attnhost.hookimpl\ndef attnhost_atention_backends():\n    return []\n"


def test_an_unknown_name_blames_its_failed_plugin_everywhere_and_offers_no_near_name(tmp_path: Path) -> None:
    """``acme`` is close to the built-in ``ascend`` in spelling only: once plugin ``acme`` failed, that is the cause."""
    make_plugin(tmp_path, "acme-attn", "1.0", "acme", "acme_attn", MISSPELLED_HOOK)
    code = "from attnhost import ServerArgs\ntry:\n    ServerArgs(attention_backend='acme')\n"
    code += "except Exception as e:\n    print(e)\n"
    resolve = run_cli("resolve", "--attention-backend", "acme", path_entries=[tmp_path])
    errors = {
        "list": run_cli("list", "acme", path_entries=[tmp_path]).stderr.strip().splitlines()[-1],
        "resolve": resolve.stderr.strip().splitlines()[-1],
        "ServerArgs": run_python(code, path_entries=[tmp_path]).stdout.strip(),
    }
    blamed = "unknown attention backend 'acme': plugin 'acme' (distribution acme-attn 1.0), which would likely"
    for where, error in errors.items():
        assert "ascend" not in error and blamed in error, (where, error)
        assert "failed to load: implements unknown hook 'attnhost_atention_backends'" in error, (where, error)
        assert "fix that plugin, then check `attnhost plugins`" in error, (where, error)


def test_an_unknown_name_names_every_failed_plugin_that_may_provide_it(tmp_path: Path) -> None:
    make_plugin(tmp_path, "acme-attn", "1.0", "acme", "acme_attn", "raise ImportError('libacme.so missing')")
    make_plugin(tmp_path, "acme-fp8", "2.0", "acme_fp8", "acme_fp8", MISSPELLED_HOOK)
    make_plugin(tmp_path, "vendorx-kernels", "1.0", "vendorx", "vendorx_attn", "raise ImportError('unrelated')")
    error = run_cli("list", "acme", path_entries=[tmp_path]).stderr.strip().splitlines()[-1]
    assert "2 plugins that would likely provide it failed to load: plugin 'acme' (distribution acme-attn" in error
    assert "; plugin 'acme_fp8' (distribution acme-fp8 2.0) (implements unknown hook" in error, error
    assert error.endswith("fix them, then check `attnhost plugins`") and "vendorx" not in error, error


def test_the_related_failed_plugins_rule_matches_name_or_distribution_either_way() -> None:
    from attnhost.discovery import PluginInfo, PluginStatus
    from attnhost.registry import Registry

    def failed(name: str, distribution: str | None) -> PluginInfo:
        return PluginInfo(name, distribution, "1.0", name, PluginStatus.FAILED, error="boom")

    acme, kernels, inproc = failed("acme", "Acme-Attn"), failed("vendorx", "acme-kernels"), failed("zed", None)
    registry = Registry({}, {}, (), [acme, kernels, inproc])
    assert registry.failed_plugins_for("acme") == (acme, kernels)  # the name, or the distribution, contains it
    assert registry.failed_plugins_for("ACME_ATTN") == (acme,)  # case and -/_ ignored
    assert registry.failed_plugins_for("zed_flash") == (inproc,)  # the unknown name contains the plugin's
    assert registry.failed_plugins_for("ascend") == () and registry.failed_plugins_for("") == ()


@pytest.mark.torch  # the shorthand class subclasses torch_native, whose module imports torch
def test_a_backend_without_a_description_shows_a_dash(tmp_path: Path) -> None:
    make_plugin(tmp_path, "nodoc-attn", "1.0", "nodoc", "nodoc_attn", NODOC, "NoDocstring")
    row = json.loads(run_cli("list", "nodoc", "--json", path_entries=[tmp_path]).stdout)["backend"]
    assert row["description"] == "", row  # not TorchNativeAttnBackend's, which describes another backend
    one = run_cli("list", "nodoc", path_entries=[tmp_path]).stdout
    assert re.search(r"^description\s+-$", one, re.M), one
    wide = run_cli("list", "--wide", path_entries=[tmp_path]).stdout
    assert re.search(r"^nodoc .* -$", wide, re.M), wide


def test_list_name_shows_where_a_backend_is_the_draft_fallback_and_its_factory(tmp_path: Path) -> None:
    make_plugin(tmp_path, "cpu-draft-attn", "1.0", "cpudraft", "cpu_draft_plugin_w7", FALLBACK_HOOKS)
    one = run_cli("list", "cpu_draft", path_entries=[tmp_path]).stdout
    assert re.search(r"^draft fallback\s+on cpu \(hook attnhost_draft_fallback, plugin 'cpudraft'\)$", one, re.M), one
    assert "factory" not in one  # the narrow view keeps to what a user needs; --wide adds it
    wide = run_cli("list", "cpu_draft", "--wide", path_entries=[tmp_path]).stdout
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    assert re.search(rf"^factory\s+{factory}$", wide, re.M), wide
    data = json.loads(run_cli("list", "flashinfer", "--json", path_entries=[tmp_path]).stdout)["backend"]
    assert [p.partition(" ")[0] for p in data["draft_fallback_on"]] == ["cuda", "xpu", "npu", "mps"], data
    assert data["factory"] is None  # declared only
    shown = json.loads(run_cli("list", "cpu_draft", "--json", path_entries=[tmp_path]).stdout)["backend"]
    assert shown["factory"] == factory and shown["draft_fallback_on"] == [
        "cpu (hook attnhost_draft_fallback, plugin 'cpudraft')"
    ]


def test_the_plugin_guide_names_the_importable_base_of_torch_native() -> None:
    pytest.importorskip("torch")
    reference = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    assert reference in plugin_guide()
    import importlib

    from attnhost import AttentionBackend

    module, _, attr = reference.partition(":")
    assert issubclass(getattr(importlib.import_module(module), attr), AttentionBackend)


KIT = textwrap.dedent(
    """
    from attnhost.testing import BackendConformance


    class TestAcme(BackendConformance):
        backend_name = "acme"


    class TestNoDocstring(BackendConformance):
        backend_name = "nodoc"
        check_discovery_imports = False  # a shorthand class is imported by discovery, and this one imports torch
    """
)


@pytest.mark.torch
def test_the_kit_fails_a_missing_factory_once_and_warns_about_a_missing_description(
    acme_site: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from test_conformance import run_pytest

    make_plugin(tmp_path / "site", "nodoc-attn", "1.0", "nodoc", "nodoc_attn", NODOC, "NoDocstring")
    (tmp_path / "test_kit.py").write_text(KIT)
    proc, results = run_pytest(["-rs"], cwd=tmp_path, path_entries=[acme_site, tmp_path / "site"])
    acme = {name: o for (cls, name), o in results.items() if cls == "TestAcme"}
    failed = {name: o.message for name, o in acme.items() if o.status in ("failed", "error")}
    assert list(failed) == ["test_spec_factory_importable_and_available"], failed
    assert failed["test_spec_factory_importable_and_available"].startswith(
        f"spec: backend 'acme' cannot run: {MISSING}"
    )
    skipped = {name: o.message for name, o in acme.items() if o.status == "skipped"}
    assert set(skipped) == set(acme) - set(failed)
    assert all(message.startswith("factory not importable") for message in skipped.values()), skipped
    nodoc = {name: o.status for (cls, name), o in results.items() if cls == "TestNoDocstring"}
    assert "failed" not in nodoc.values() and "error" not in nodoc.values(), nodoc
    assert nodoc["test_spec_name_and_description"] == "passed"
    assert "ConformanceWarning: backend 'nodoc' has no description" in proc.stdout, proc.stdout
    assert len(proc.stdout) < 20_000, len(proc.stdout)  # one failure, not 17 pages of tracebacks
