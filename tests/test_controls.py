"""Load controls on real distributions: allow-list, autoload off, strict mode, and "not loaded = never imported".

Every plugin module appends its name to a marker file when it is imported,
so a test can prove a plugin that was not loaded never ran any code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import make_plugin, run_cli, run_python

PLUGIN = """
import os
import attnhost

with open(os.environ["MARKER"], "a") as f:
    f.write("{name}\\n")

@attnhost.hookimpl
def attnhost_attention_backends():
    return [attnhost.BackendSpec(name="{name}_backend", factory="{name}_kernels:Backend")]
"""

BROKEN = "raise ImportError('{name} is broken')\n"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """Plugins alpha, beta, gamma (good), and a second distribution also claiming the name 'alpha'."""
    site = tmp_path / "site"
    for name in ("alpha", "beta", "gamma"):
        make_plugin(site, f"{name}-attn", "1.0", name, f"{name}_plugin", PLUGIN.format(name=name))
    # Same entry-point name from another distribution: sorts after 'alpha-attn', so it is the duplicate.
    make_plugin(site, "zz-alpha-clone", "9.9", "alpha", "alpha_clone", PLUGIN.format(name="alpha_clone"))
    return site


def _run(site: Path, *args: str, **env: str) -> tuple[Any, str, list[str]]:
    marker = site.parent / "marker"
    marker.unlink(missing_ok=True)
    full_env = {"MARKER": str(marker), "XDG_CACHE_HOME": str(site.parent / "cache"), **env}
    result = run_cli(*args, "--json", path_entries=[site], env=full_env)
    assert "Traceback" not in result.stderr, result.stderr
    imported = marker.read_text().split() if marker.exists() else []
    data = json.loads(result.stdout) if result.returncode == 0 else None
    return data, result.stderr if result.returncode == 0 else f"exit {result.returncode}: {result.stderr}", imported


def _status(data: Any) -> dict[tuple[str, str], str]:
    return {(p["name"], p["distribution"]): p["status"] for p in data["plugins"]}


def test_all_plugins_load_by_default_and_the_duplicate_is_never_imported(site: Path) -> None:
    data, stderr, imported = _run(site, "plugins")
    assert sorted(imported) == ["alpha", "beta", "gamma"], "the duplicate's module must never run"
    status = _status(data)
    assert status[("alpha", "alpha-attn")] == "loaded"
    assert status[("alpha", "zz-alpha-clone")] == "duplicate"
    warnings = [line for line in stderr.splitlines() if "zz-alpha-clone" in line]
    assert len(warnings) == 1 and "already taken by distribution alpha-attn" in warnings[0]


def test_allow_list_loads_only_named_plugins_plus_builtins(site: Path) -> None:
    data, stderr, imported = _run(site, "plugins", ATTNHOST_PLUGINS="beta, nothere,")
    assert imported == ["beta"], "plugins left out of ATTNHOST_PLUGINS are never imported"
    status = _status(data)
    assert status[("builtin", "attnhost")] == "loaded"
    assert status[("beta", "beta-attn")] == "loaded"
    assert status[("alpha", "alpha-attn")] == status[("gamma", "gamma-attn")] == "not-allowed"
    errors = {p["name"]: p["error"] for p in data["plugins"]}
    assert errors["gamma"] == "not named in ATTNHOST_PLUGINS"
    lines = stderr.splitlines()
    missing = [line for line in lines if "'nothere'" in line]
    assert (
        len(missing) == 1
        and "not installed" in missing[0]
        and "(installed plugins: alpha, beta, builtin, gamma)" in missing[0]
    )
    backends, _, _ = _run(site, "list", ATTNHOST_PLUGINS="beta")
    names = {b["name"] for b in backends["backends"]}
    assert "beta_backend" in names and "alpha_backend" not in names and "torch_native" in names


def test_disabling_autoload_keeps_only_builtins_and_imports_nothing(site: Path) -> None:
    data, _, imported = _run(site, "plugins", ATTNHOST_DISABLE_PLUGIN_AUTOLOAD="1", ATTNHOST_PLUGINS="alpha")
    assert imported == []
    status = _status(data)
    assert status.pop(("builtin", "attnhost")) == "loaded"
    assert set(status.values()) <= {"blocked", "duplicate"}
    assert status[("gamma", "gamma-attn")] == "blocked"
    assert "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD is set" in {p["error"] for p in data["plugins"]}


def test_strict_mode_fails_the_cli_naming_every_failed_plugin(tmp_path: Path, site: Path) -> None:
    make_plugin(site, "broken-one", "0.1", "broken_one", "broken_one", BROKEN.format(name="one"))
    make_plugin(site, "broken-two", "0.2", "broken_two", "broken_two", BROKEN.format(name="two"))
    data, report, _ = _run(site, "list", ATTNHOST_STRICT="1")
    assert data is None and report.startswith("exit 1:")
    error = report.removeprefix("exit 1: ").splitlines()
    assert len(error) == 1 and error[0].startswith("attnhost: error: "), report  # no warning repeats it
    assert "plugin 'broken_one' (distribution broken-one 0.1): importing 'broken_one' raised ImportError" in error[0]
    assert "plugin 'broken_two' (distribution broken-two 0.2)" in error[0]
    assert "plugin 'alpha' (distribution zz-alpha-clone 9.9)" in error[0]  # a duplicate counts too
    # `plugins` still prints its report (it is the debugging command), then fails the same way.
    shown = run_cli("plugins", path_entries=[site], env={"ATTNHOST_STRICT": "1", "MARKER": str(site.parent / "m")})
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "broken_one" in shown.stdout and "failed" in shown.stdout
    assert shown.stderr.strip().splitlines()[-1].startswith("attnhost: error: ATTNHOST_STRICT=1")
    assert "Traceback" not in shown.stderr
    # Without strict mode the same environment is only warnings.
    data, _, _ = _run(site, "list")
    assert data is not None


def test_strict_mode_raises_in_the_api_and_counts_missing_allowed_names(site: Path) -> None:
    code = (
        "import attnhost\n"
        "try:\n"
        "    attnhost.get_registry()\n"
        "except attnhost.PluginLoadError as exc:\n"
        "    print('raised', exc)\n"
        "else:\n"
        "    print('ok')\n"
    )
    env = {"MARKER": str(site.parent / "marker"), "ATTNHOST_STRICT": "1"}
    clean = run_python(code, path_entries=[site], env={**env, "ATTNHOST_PLUGINS": "beta"})
    assert clean.stdout.strip() == "ok", clean.stdout + clean.stderr
    missing = run_python(code, path_entries=[site], env={**env, "ATTNHOST_PLUGINS": "beta,nothere"})
    assert missing.stdout.startswith("raised ATTNHOST_STRICT=1"), missing.stdout + missing.stderr
    assert "ATTNHOST_PLUGINS names plugin 'nothere', which is not installed" in missing.stdout


def test_strict_mode_off_by_falsy_values(site: Path) -> None:
    for value in ("0", "", "no"):
        data, _, _ = _run(site, "list", ATTNHOST_STRICT=value)
        assert data is not None, value
