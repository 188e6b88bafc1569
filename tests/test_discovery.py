"""Discovery from real installed distributions (dist-info on a temporary path), in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import GROUP, list_json, make_plugin, run_cli, run_python, subprocess_env

import attnhost

HOOK_PLUGIN = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return [
        attnhost.BackendSpec(
            name="acme", factory="acme_kernels:AcmeBackend", aliases=("acme_v1",),
            platforms=("cpu",), requires=("acme_kernels",), description="ACME fused attention",
        ),
        attnhost.BackendSpec(name="acme_target_only", factory="acme_kernels:AcmeBackend"),
    ]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["acme_v1"]
"""

# The factory module records that it was imported; discovery must never import it.
ACME_KERNELS = "import os\nopen(os.environ['ACME_MARKER'], 'w').write('imported')\nclass AcmeBackend: pass\n"

SHORTHAND = '''
import attnhost

class Tiny(attnhost.AttentionBackend):
    """A tiny backend declared with the one-line shorthand."""
    def init_forward_metadata(self, forward_batch): pass
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True): raise NotImplementedError
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True): raise NotImplementedError
'''


def _backends(data: dict) -> dict[str, dict]:
    return {b["name"]: b for b in data["backends"]}


def test_hook_plugin_is_discovered_with_provenance_and_not_imported(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "acme-attention", "2.3.1", "acme", "acme_plugin", HOOK_PLUGIN)
    (site / "acme_kernels.py").write_text(ACME_KERNELS)
    marker = tmp_path / "marker"
    data = list_json([site], env={"ACME_MARKER": str(marker)})
    backends = _backends(data)
    acme = backends["acme"]
    assert acme["plugin"] == "acme"
    assert acme["distribution"] == "acme-attention" and acme["version"] == "2.3.1"
    assert acme["roles"] == ["target", "draft"] and acme["aliases"] == ["acme_v1"]
    assert acme["implemented"] is True and acme["available"] is True
    assert backends["acme_target_only"]["roles"] == ["target"]
    assert backends["torch_native"]["plugin"] == "builtin"
    assert not marker.exists(), "listing must not import a backend's factory module"
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["acme"]["status"] == "loaded"
    assert plugins["acme"]["backends"] == ["acme", "acme_target_only"]


def test_shorthand_entry_point_is_target_and_draft(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "tiny-attn", "0.1", "tiny", "tiny_attn", SHORTHAND, attr="Tiny")
    data = list_json([site])
    tiny = _backends(data)["tiny"]
    assert tiny["roles"] == ["target", "draft"]
    assert tiny["description"] == "A tiny backend declared with the one-line shorthand."
    assert tiny["distribution"] == "tiny-attn" and tiny["version"] == "0.1"


def test_table_shows_plugin_distribution_and_availability(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "tiny-attn", "0.1", "tiny", "tiny_attn", SHORTHAND, attr="Tiny")
    result = run_cli("list", "--wide", path_entries=[site], env={"ATTNHOST_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ROLES", "PLUGIN", "DISTRIBUTION", "IMPLEMENTED", "AVAILABLE", "DESCRIPTION"]
    tiny = next(line for line in lines if line.startswith("tiny "))
    assert "target,draft" in tiny and "tiny-attn 0.1" in tiny and " yes " in tiny
    flashinfer = next(line for line in lines if line.startswith("flashinfer "))
    assert "no: declared only" in flashinfer and "flashinfer-python" in flashinfer
    assert "platform cpu" in result.stdout
    # columns are aligned: every row starts its PLUGIN column at the same offset
    offset = lines[0].index("PLUGIN")
    assert all(line[offset - 2 : offset] == "  " for line in lines[1:24])


def test_draft_filter(tmp_path: Path) -> None:
    result = run_cli("list", "--json", "--draft")
    assert result.returncode == 0, result.stderr
    names = {b["name"] for b in json.loads(result.stdout)["backends"]}
    assert names == {"flashinfer", "fa3", "fa4", "triton", "ascend", "trtllm_mha", "intel_xpu"}


def test_loading_is_idempotent_per_process(tmp_path: Path) -> None:
    site = tmp_path / "site"
    counter = tmp_path / "count"
    source = (
        f"import attnhost\nwith open({str(counter)!r}, 'a') as f: f.write('x')\n"
        + HOOK_PLUGIN.split("import attnhost", 1)[1]
    )
    make_plugin(site, "acme-attention", "1.0", "acme", "acme_plugin", source)
    code = (
        "import attnhost\n"
        "a = attnhost.get_registry(); b = attnhost.get_registry()\n"
        "pm1 = attnhost.get_plugin_manager(); pm2 = attnhost.get_plugin_manager()\n"
        "assert a is b and pm1 is pm2\n"
        "print(len([n for n, _ in pm1.list_name_plugin()]))\n"
    )
    result = run_python(code, path_entries=[site])
    assert result.returncode == 0, result.stderr
    assert counter.read_text() == "x"


def test_list_never_imports_torch_or_backend_modules(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "acme-attention", "1.0", "acme", "acme_plugin", HOOK_PLUGIN)
    code = (
        "import sys, attnhost\n"
        "assert 'torch' not in sys.modules and 'pluggy' not in sys.modules, sorted(sys.modules)\n"
        "from attnhost.cli import main\n"
        "import io; out = io.StringIO()\n"
        "assert main(['list'], out=out) == 0\n"
        "assert main(['list', '--json'], out=out) == 0\n"
        "heavy = ('torch.', 'attnhost_builtin.', 'acme_kernels')\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(heavy)]\n"
        "assert not bad, bad\n"
        "assert 'attnhost.runner' not in sys.modules and 'attnhost.forward_batch' not in sys.modules\n"
        "print('ok')\n"
    )
    result = run_python(code, path_entries=[site])
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stdout.strip().endswith("ok")


def test_python_dash_m_and_console_script_agree() -> None:
    import shutil
    import subprocess

    script = shutil.which("attnhost")
    assert script, "the console script 'attnhost' is installed with the package"
    a = subprocess.run([script, "list", "--json"], capture_output=True, text=True, timeout=120)
    b = run_cli("list", "--json")
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_entry_point_group_is_sglangs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    # The same plugin under a different group is not ours and must not be loaded.
    make_dist(
        site, "other-group", "1.0", {"some.other.group": {"acme": "acme_plugin"}}, modules={"acme_plugin": HOOK_PLUGIN}
    )
    names = _backends(list_json([site]))
    assert "acme" not in names
    assert GROUP == "sglang.draft_attention_backends"


# --------------------------------------------------------------------------- the built-in is who it is

IMPOSTOR_MODULE = "import os\nopen(os.environ['IMPOSTOR_MARKER'], 'a').write(__name__ + '\\n')\n" + HOOK_PLUGIN.replace(
    '"acme"', '"evil_backend"'
).replace('"acme_target_only"', '"evil_target_only"').replace('["acme_v1"]', "[]").replace('aliases=("acme_v1",), ', "")


def _impostor(site: Path, dist: str, version: str, metadata_name: str) -> None:
    """A distribution whose METADATA says it is attnhost, declaring a 'builtin' entry point and one of its own."""
    make_dist(
        site,
        dist,
        version,
        {GROUP: {"builtin": "evil_builtin", "evil": "evil_plugin"}},
        modules={"evil_builtin": IMPOSTOR_MODULE, "evil_plugin": IMPOSTOR_MODULE},
        metadata_name=metadata_name,
    )


def _plugins(data: dict) -> list[dict]:
    return list(data["plugins"])


def _cli_elsewhere(cwd: Path, *args: str, site: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m attnhost`` run from *cwd*, so no metadata of the checkout is on the path."""
    return subprocess.run(
        [sys.executable, "-m", "attnhost", *args],
        capture_output=True,
        text=True,
        env=subprocess_env([site], env),
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("dist", "version"),
    [("evil", "6.6"), ("attnhost", "9.9")],
    ids=["claims-the-name", "shadows-the-real-distribution"],
)
def test_an_impostor_named_attnhost_cannot_displace_the_builtin(tmp_path: Path, dist: str, version: str) -> None:
    site = tmp_path / "site"
    _impostor(site, dist, version, metadata_name="attnhost")
    marker = tmp_path / "imported"
    result = _cli_elsewhere(tmp_path, "list", "--json", site=site, env={"IMPOSTOR_MARKER": str(marker)})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    plugins = _plugins(data)
    builtins = [p for p in plugins if p["builtin"]]
    assert len(builtins) == 1
    assert builtins[0]["name"] == "builtin" and builtins[0]["value"] == "attnhost_builtin"
    assert builtins[0]["status"] == "loaded" and builtins[0]["version"] == attnhost.__version__
    fake = [p for p in plugins if p["name"] == "builtin" and not p["builtin"]]
    assert [p["status"] for p in fake] == ["duplicate"] and "built-in" in fake[0]["error"]
    assert "plugin 'builtin' (distribution attnhost " + version in result.stderr  # reported as a collision
    evil = next(p for p in plugins if p["name"] == "evil")
    assert evil["status"] == "loaded" and evil["builtin"] is False  # an ordinary third-party plugin
    assert _backends(data)["torch_native"]["plugin"] == "builtin"
    assert marker.read_text().split() == ["evil_plugin"]  # its 'builtin' module was never imported


@pytest.mark.parametrize(
    "env",
    [{"ATTNHOST_DISABLE_PLUGIN_AUTOLOAD": "1"}, {"ATTNHOST_PLUGINS": "acme"}],
    ids=["autoload-disabled", "allow-list"],
)
def test_an_impostor_named_attnhost_is_under_the_controls(tmp_path: Path, env: dict[str, str]) -> None:
    site = tmp_path / "site"
    _impostor(site, "evil", "6.6", metadata_name="attnhost")
    marker = tmp_path / "imported"
    result = _cli_elsewhere(tmp_path, "plugins", "--json", site=site, env={"IMPOSTOR_MARKER": str(marker), **env})
    assert result.returncode == 0, result.stderr
    status = {(p["name"], p["builtin"]): p["status"] for p in json.loads(result.stdout)["plugins"]}
    assert status[("builtin", True)] == "loaded"
    assert status[("evil", False)] in ("blocked", "not-allowed")
    assert status[("builtin", False)] == "duplicate"
    assert not marker.exists()


def test_no_metadata_stands_for_the_builtin(tmp_path: Path) -> None:
    """Copies of the built-in's declaration (attnhost's own, a RECORD listing another file, an editable install of
    another tree) add nothing and change none of its provenance; its name for another module is a collision."""
    import contextlib

    from attnhost.discovery import BUILTIN_MODULE, BUILTIN_PLUGIN, GuardedPluginManager, load_entry_points
    from attnhost.entry_points import EntryPointRecord, scan
    from attnhost.settings import LoadSettings

    copy = make_dist(tmp_path / "copy", "attnhost", "9.9", {GROUP: {"builtin": BUILTIN_MODULE}})
    (copy / "RECORD").write_text("attnhost/__init__.py,sha256=x,1\n")  # lists a file, but not *this* one
    elsewhere = make_dist(tmp_path / "other", "attnhost", "9.9", {GROUP: {"builtin": BUILTIN_MODULE}})
    (elsewhere / "direct_url.json").write_text(
        json.dumps({"url": (tmp_path / "src").as_uri(), "dir_info": {"editable": True}})
    )

    def record(source: Path, value: str = BUILTIN_MODULE) -> EntryPointRecord:
        return EntryPointRecord(BUILTIN_PLUGIN, value, GROUP, "attnhost", "9.9", str(source.parent), str(source))

    records = [*scan(GROUP, use_cache=False), record(copy), record(elsewhere), record(copy, value="evil_builtin")]
    pm = GuardedPluginManager(lambda what: contextlib.nullcontext())
    plugins = load_entry_points(pm, records, LoadSettings(allow=None, autoload=False, strict=False))
    rows = [(p.name, p.distribution, p.version, p.value, p.status.value, p.builtin) for p in plugins]
    assert rows[0] == ("builtin", "attnhost", attnhost.__version__, BUILTIN_MODULE, "loaded", True)
    assert [row for row in rows[1:] if row[0] == "builtin"] == [
        ("builtin", "attnhost", "9.9", "evil_builtin", "duplicate", False)
    ]
