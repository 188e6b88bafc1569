"""Name collisions between real plugin distributions: reported naming both sides, resolved deterministically.

The documented outcome (docs/collisions.md): plugins
register in a fixed order — the built-ins first, then the plugins ATTNHOST_PLUGINS
lists in its order, then the rest sorted by
entry-point name — whatever the order on ``sys.path``. The first registrant
keeps a name; a declared-only name may be given an implementation by a later
plugin; a second implementation of one name, or an alias equal to a taken
name, is ignored with a warning naming both plugins and distributions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import list_json, make_plugin, run_cli

import attnhost
from attnhost import BackendSpec


def _plugin(*specs: str) -> str:
    body = ", ".join(specs)
    source = "import attnhost\nfrom attnhost import BackendSpec\n\n"
    source += f"@attnhost.hookimpl\ndef attnhost_attention_backends():\n    return [{body}]\n"
    return source


@pytest.fixture
def sites(tmp_path: Path) -> list[Path]:
    """Each distribution in its own directory, so the test can reorder them on the path."""
    plugins = [
        # 'alpha' and 'beta' both implement 'shared'; alpha sorts first, though its distribution sorts last.
        ("zz-alpha-dist", "alpha", _plugin("BackendSpec(name='shared', factory='a:B', aliases=('uno',))")),
        (
            "aa-beta-dist",
            "beta",
            _plugin("BackendSpec(name='shared', factory='b:B')", "BackendSpec(name='uno', factory='b:U')"),
        ),
        # 'gamma' gives its backend an alias that is alpha's backend name.
        ("gamma-dist", "gamma", _plugin("BackendSpec(name='gamma_be', factory='g:B', aliases=('shared', 'g'))")),
        # 'fi' implements the built-in declared-only 'flashinfer'; 'fi2' tries too, later.
        ("fi-dist", "fi", _plugin("BackendSpec(name='flashinfer', factory='fi:B', aliases=('fi_alias',))")),
        ("fi2-dist", "fi2", _plugin("BackendSpec(name='flashinfer', factory='fi2:B')")),
        # 'dsa_impl' implements the built-in 'dsa', whose alias is 'nsa'.
        ("dsa-dist", "dsa_impl", _plugin("BackendSpec(name='dsa', factory='d:B')")),
    ]
    out = []
    for dist, name, source in plugins:
        site = tmp_path / dist
        make_plugin(site, dist, "1.0", name, f"{name}_plugin", source)
        out.append(site)
    return out


def _backends(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in data["backends"]}


def test_collisions_are_reported_naming_both_plugins_and_resolved_deterministically(sites: list[Path]) -> None:
    forward = run_cli("list", "--json", path_entries=sites)
    backward = run_cli("list", "--json", path_entries=list(reversed(sites)))
    assert forward.returncode == backward.returncode == 0
    assert forward.stdout == backward.stdout, "the outcome must not depend on sys.path order"
    assert sorted(forward.stderr.splitlines()) == sorted(backward.stderr.splitlines())
    warnings = forward.stderr.splitlines()
    assert all(line.startswith("attnhost: warning: ") for line in warnings)

    def one(*needles: str) -> str:
        hits = [line for line in warnings if all(n in line for n in needles)]
        assert len(hits) == 1, (needles, warnings)
        return hits[0]

    line = one("backend 'shared' is implemented by both")
    assert "plugin 'alpha' (distribution zz-alpha-dist 1.0)" in line
    assert "plugin 'beta' (distribution aa-beta-dist 1.0)" in line and "keeping 'alpha'" in line
    line = one("registers backend 'uno', which is already an alias of 'shared'")
    assert "plugin 'beta' (distribution aa-beta-dist 1.0)" in line and "zz-alpha-dist" in line
    line = one("the alias 'shared', which already names 'shared'")
    assert (
        "plugin 'gamma' (distribution gamma-dist 1.0)" in line and "plugin 'alpha' (distribution zz-alpha-dist" in line
    )
    line = one("backend 'flashinfer' is implemented by both")
    assert "plugin 'fi' (distribution fi-dist 1.0)" in line and "plugin 'fi2' (distribution fi2-dist 1.0)" in line
    assert len(warnings) == 4

    backends = _backends(json.loads(forward.stdout))
    assert backends["shared"]["plugin"] == "alpha" and backends["shared"]["aliases"] == ["uno"]
    assert "uno" not in backends
    assert backends["gamma_be"]["aliases"] == ["shared", "g"]  # declared, but only 'g' resolves to it
    flashinfer = backends["flashinfer"]
    assert flashinfer["plugin"] == "fi" and flashinfer["declared_by"] == "builtin"
    assert flashinfer["implemented"] and flashinfer["roles"] == ["target", "draft"], "takes over draft capability"
    assert flashinfer["aliases"] == ["fi_alias"] and flashinfer["provided_by"] == "flashinfer-python"
    dsa = backends["dsa"]
    assert dsa["plugin"] == "dsa_impl" and dsa["aliases"] == ["nsa"] and dsa["implemented"]


def test_the_user_decides_a_collision_by_the_order_of_attnhost_plugins(sites: list[Path]) -> None:
    """Without a choice the entry points' order decides (alpha keeps 'shared'), and the warning says how to choose;
    ``ATTNHOST_PLUGINS=beta,alpha`` gives the name to beta, and both plugins load."""
    default = run_cli("list", "--json", path_entries=sites)
    line = next(line for line in default.stderr.splitlines() if "backend 'shared' is implemented by both" in line)
    assert "list the plugins in ATTNHOST_PLUGINS in the order you prefer (the first listed keeps" in line, line
    chosen = run_cli("list", "--json", path_entries=sites, env={"ATTNHOST_PLUGINS": "beta,alpha"})
    assert chosen.returncode == 0, chosen.stderr
    backends = _backends(json.loads(chosen.stdout))
    assert backends["shared"]["plugin"] == "beta" and backends["uno"]["plugin"] == "beta"
    line = next(line for line in chosen.stderr.splitlines() if "backend 'shared' is implemented by both" in line)
    assert "keeping 'beta'" in line, line
    loaded = {p["name"]: p["status"] for p in json.loads(chosen.stdout)["plugins"]}
    assert loaded["alpha"] == loaded["beta"] == "loaded" and loaded["gamma"] == "not-allowed", loaded


def test_alias_resolution_follows_the_winner(sites: list[Path]) -> None:
    result = run_cli(
        "resolve", "--json", "--attention-backend", "g", "--prefill-attention-backend", "nsa", path_entries=sites
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["prefill"] == "dsa" and data["decode"] == "gamma_be"


def test_plugins_json_carries_each_plugins_collision_warnings(sites: list[Path]) -> None:
    data = json.loads(run_cli("plugins", "--json", path_entries=sites).stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["alpha"]["warnings"] == [] and plugins["alpha"]["backends"] == ["shared"]
    assert len(plugins["beta"]["warnings"]) == 2 and plugins["beta"]["backends"] == []
    assert plugins["fi"]["backends"] == ["flashinfer"] and plugins["fi2"]["backends"] == []
    assert all(p["status"] == "loaded" for p in plugins.values())


def test_strict_mode_turns_a_collision_into_an_error(sites: list[Path]) -> None:
    result = run_cli("list", path_entries=sites[:2], env={"ATTNHOST_STRICT": "1"})
    assert result.returncode == 1
    assert "attnhost: error: ATTNHOST_STRICT=1" in result.stderr and "implemented by both" in result.stderr
    assert list_json(sites[2:3], env={"ATTNHOST_STRICT": "1"})  # gamma alone collides with nobody


def test_in_process_collisions_follow_the_same_rules(caplog: pytest.LogCaptureFixture) -> None:
    class Twice:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name="dup", factory="m:A"), BackendSpec(name="dup", factory="m:B")]

    class AliasOnBuiltin:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name="mine", factory="m:C", aliases=("triton", "mine_alias"))]

    attnhost.register_plugin(Twice(), name="twice")
    attnhost.register_plugin(AliasOnBuiltin(), name="alias-on-builtin")
    registry = attnhost.get_registry()
    assert registry["dup"].factory == "m:A"
    assert registry.canonical("triton") == "triton" and registry.canonical("mine_alias") == "mine"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("registers backend 'dup' twice" in m for m in messages) == 1
    assert sum("the alias 'triton', which already names 'triton'" in m for m in messages) == 1
