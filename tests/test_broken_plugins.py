"""Broken and hostile plugins never break the host: one real environment holding every kind of breakage.

Each broken plugin is a genuinely installed distribution (dist-info on a
temporary path) next to one good plugin. ``attnhost list``, ``plugins`` and
``resolve`` must exit 0 with the good backends intact, print no traceback,
and print exactly one warning line per broken plugin naming the plugin, its
distribution and the cause. One environment for all cases keeps this fast.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from distgen import make_dist
from helpers import GROUP, run_cli, run_python

import attnhost


@dataclass(frozen=True)
class Broken:
    """One broken plugin: entry point ``name`` in distribution ``dist`` and the cause its warning must give."""

    name: str
    source: str | None
    cause: str
    attr: str | None = None
    value: str | None = None

    @property
    def dist(self) -> str:
        return f"broken-{self.name}"

    @property
    def module(self) -> str:
        return f"broken_{self.name}"


def _hook(body: str, hook: str = "attnhost_attention_backends") -> str:
    return f"import attnhost\n\n@attnhost.hookimpl\ndef {hook}():\n    {body}\n"


BROKEN = [
    Broken(
        "missing_module",
        None,
        "raised ModuleNotFoundError: No module named 'no_such_module_xyz'",
        value="no_such_module_xyz:plugin",
    ),
    Broken(
        "missing_attr",
        "x = 1\n",
        "raised AttributeError: module 'broken_missing_attr' has no attribute 'nope'",
        attr="nope",
    ),
    Broken(
        "import_raises",
        "raise RuntimeError('boom at import\\nsecond line')\n",
        "importing 'broken_import_raises' raised RuntimeError: boom at import",
    ),
    Broken("import_exits", "import sys\nsys.exit(3)\n", "importing 'broken_import_exits' raised SystemExit: 3"),
    Broken(
        "unprintable",
        "class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError\nraise Odd()\n",
        "raised Odd: <exception with a broken __str__>",
    ),
    Broken(
        "hook_raises",
        _hook("raise ValueError('hook boom')"),
        "hook attnhost_attention_backends raised ValueError: hook boom",
    ),
    Broken("hook_exits", _hook("raise SystemExit('bye')"), "hook attnhost_attention_backends raised SystemExit: bye"),
    Broken("returns_str", _hook("return 'abc'"), "attnhost_attention_backends() returned str 'abc'"),
    Broken("returns_none", _hook("return None"), "attnhost_attention_backends() returned NoneType None"),
    Broken("returns_dict", _hook("return {'a': 1}"), "attnhost_attention_backends() returned dict"),
    Broken("returns_ints", _hook("return [1, 2]"), "returned a list containing int 1"),
    Broken("empty_name", _hook("return [attnhost.BackendSpec(name='')]"), "invalid backend name ''"),
    Broken("bad_name", _hook("return [attnhost.BackendSpec(name='bad name!')]"), "invalid backend name 'bad name!'"),
    Broken(
        "draft_str",
        _hook("return 'good'", "attnhost_draft_attention_backends"),
        "attnhost_draft_attention_backends() returned str 'good'",
    ),
    Broken(
        "draft_bad_name",
        _hook("return ['bad name!']", "attnhost_draft_attention_backends"),
        "invalid draft backend name 'bad name!'",
    ),
    Broken(
        "forty_two",
        "plugin = 42\n",
        "entry point object (int 42) is neither an attnhost.AttentionBackend",
        attr="plugin",
    ),
    Broken(
        "bad_repr",
        "class X:\n    def __repr__(self):\n        raise RuntimeError\nplugin = X()\n",
        "<X object with a broken __repr__>",
        attr="plugin",
    ),
    Broken(
        "multiline_repr",
        "class X:\n    def __repr__(self):\n        return 'one\\ntwo'\nplugin = X()\n",
        "(X one two) is neither",
        attr="plugin",
    ),
    Broken(
        "unknown_hook",
        _hook("return []", "attnhost_attention_backend"),
        "unknown hook 'attnhost_attention_backend'; did you mean 'attnhost_attention_backends'?",
    ),
    Broken(
        "undecorated", "def attnhost_attention_backends():\n    return []\n", "without the @attnhost.hookimpl decorator"
    ),
    Broken(
        "bad_signature",
        "import attnhost\n\n@attnhost.hookimpl\ndef attnhost_draft_fallback(platform, extra):\n    return None\n",
        "Argument(s) {'extra'} are declared in the hookimpl but can not be found in the hookspec",
    ),
    Broken(
        "abstract_class",
        "import attnhost\nclass Half(attnhost.AttentionBackend):\n    pass\n",
        "the backend class Half is abstract",
        attr="Half",
    ),
    Broken(
        "reads_registry_at_import",
        "import attnhost\nattnhost.get_registry()\n",
        "raised AttnhostError: the backend registry was requested while plugins are still being imported",
    ),
    Broken(
        "builds_args_at_import",
        "import attnhost\nattnhost.ServerArgs()\n",
        "raised AttnhostError: the backend registry was requested while plugins are still being imported",
    ),
    Broken(
        "reads_registry_in_hook",
        _hook("attnhost.get_registry(); return []"),
        "raised AttnhostError: the backend registry was requested from inside a plugin hook",
    ),
    Broken(
        "registers_in_hook",
        _hook("attnhost.add_attention_backend_choices(['sneaky']); return []"),
        "raised AttnhostError: add_attention_backend_choices(['sneaky']) from inside a plugin hook",
    ),
]

GOOD = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return [attnhost.BackendSpec(name="good", factory="good_kernels:Backend", aliases=("good_alias",))]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["good"]
"""

# Loads fine, but declares a draft name nobody registered: a warning, not a failure.
GHOST_DRAFT = _hook("return ['nobody_registered_this']", "attnhost_draft_attention_backends")

# Its platform hook exits: resolution must skip it and ask the built-in plugin.
EXITING_FALLBACK = (
    "import attnhost, sys\n\n@attnhost.hookimpl\ndef attnhost_draft_fallback(platform):\n    sys.exit('no')\n"
)

# SGLang-style: the legacy name-only API called while the plugin module is imported.
LEGACY_AT_IMPORT = (
    "import attnhost\n"
    "attnhost.add_attention_backend_choices(['legacy_vendor'])\n"
    "attnhost.add_draft_attention_backend_choices(['legacy_vendor'])\n"
    "plugin = None\n"
)


def _install(site: Path, name: str, dist: str, source: str | None, value: str) -> None:
    modules = {value.partition(":")[0]: source} if source is not None else None
    make_dist(site, dist, "1.0", {GROUP: {name: value}}, modules=modules)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("broken-site")
    for case in BROKEN:
        value = case.value or (f"{case.module}:{case.attr}" if case.attr else case.module)
        _install(site, case.name, case.dist, case.source, value)
    _install(site, "good", "good-attn", GOOD, "good_plugin")
    _install(site, "ghost_draft", "ghost-draft", GHOST_DRAFT, "ghost_draft_plugin")
    _install(site, "exiting_fallback", "exiting-fallback", EXITING_FALLBACK, "exiting_fallback_plugin")
    # The legacy plugin's entry point object is the module (it has no hooks of its own), so it "fails"
    # as a plugin, yet its add_*_choices calls must take effect: that is SGLang's registration style.
    _install(site, "legacy", "legacy-attn", LEGACY_AT_IMPORT, "legacy_plugin")
    return site


def _env(site: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(site.parent / (site.name + "-cache")), "ATTNHOST_PLATFORM": "cpu"}


@pytest.fixture(scope="module")
def list_run(site: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("list", "--json", path_entries=[site], env=_env(site))


@pytest.fixture(scope="module")
def plugins_json(site: Path) -> dict[str, Any]:
    result = run_cli("plugins", "--json", path_entries=[site], env=_env(site))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_list_survives_every_broken_plugin(list_run: subprocess.CompletedProcess[str]) -> None:
    assert list_run.returncode == 0, list_run.stderr
    assert "Traceback" not in list_run.stderr and "Traceback" not in list_run.stdout
    backends = {b["name"]: b for b in json.loads(list_run.stdout)["backends"]}
    good = backends["good"]
    assert good["plugin"] == "good" and good["distribution"] == "good-attn" and good["version"] == "1.0"
    assert good["aliases"] == ["good_alias"] and good["roles"] == ["target", "draft"]
    assert backends["torch_native"]["implemented"] and backends["flashinfer"]["roles"] == ["target", "draft"]
    assert backends["legacy_vendor"]["roles"] == ["target", "draft"], "import-time add_*_choices must count"
    assert "sneaky" not in backends and "nobody_registered_this" not in backends


@pytest.mark.parametrize("case", BROKEN, ids=[c.name for c in BROKEN])
def test_exactly_one_warning_line_naming_plugin_distribution_and_cause(
    case: Broken, list_run: subprocess.CompletedProcess[str]
) -> None:
    lines = [line for line in list_run.stderr.splitlines() if f"plugin {case.name!r}" in line]
    assert len(lines) == 1, list_run.stderr
    line = lines[0]
    assert line.startswith("attnhost: warning: ")
    assert f"(distribution {case.dist} 1.0)" in line and case.cause in line, line


def test_every_stderr_line_is_a_warning_about_one_plugin(list_run: subprocess.CompletedProcess[str]) -> None:
    lines = list_run.stderr.splitlines()
    assert all(line.startswith("attnhost: warning: plugin '") for line in lines), lines
    # every broken plugin, the ghost draft name and the legacy module object; nothing else
    assert len(lines) == len(BROKEN) + 2


def test_unregistered_draft_name_is_one_warning_and_the_plugin_still_loads(
    list_run: subprocess.CompletedProcess[str], plugins_json: dict[str, Any]
) -> None:
    lines = [line for line in list_run.stderr.splitlines() if "ghost_draft" in line]
    assert len(lines) == 1 and "(distribution ghost-draft 1.0)" in lines[0]
    assert "'nobody_registered_this', but no plugin registered a backend of that name" in lines[0]
    ghost = next(p for p in plugins_json["plugins"] if p["name"] == "ghost_draft")
    assert ghost["status"] == "loaded" and ghost["warnings"]


def test_plugins_json_reports_every_plugin(plugins_json: dict[str, Any]) -> None:
    plugins = {p["name"]: p for p in plugins_json["plugins"]}
    required = {"name", "distribution", "version", "value", "status", "error", "backends"}
    assert all(required <= set(p) for p in plugins.values())
    for case in BROKEN:
        info = plugins[case.name]
        assert info["status"] == "failed", info
        assert info["distribution"] == case.dist and info["version"] == "1.0"
        assert info["value"] == (case.value or (f"{case.module}:{case.attr}" if case.attr else case.module))
        assert case.cause in info["error"] and "\n" not in info["error"]
        assert info["backends"] == []
    good = plugins["good"]
    assert good["status"] == "loaded" and good["error"] is None and good["backends"] == ["good"]
    assert good["value"] == "good_plugin" and good["distribution"] == "good-attn"
    assert plugins["builtin"]["status"] == "loaded" and plugins["builtin"]["distribution"] == "attnhost"
    assert plugins["exiting_fallback"]["status"] == "loaded"


def test_plugins_table_and_resolve_survive(site: Path) -> None:
    table = run_cli("plugins", path_entries=[site], env=_env(site))
    assert table.returncode == 0 and "Traceback" not in table.stderr
    assert any(line.startswith("forty_two ") and " failed " in line for line in table.stdout.splitlines())
    # The exiting platform hook answers first (registered last) and is skipped with a warning.
    result = run_cli("resolve", "--json", "--attention-backend", "good", path_entries=[site], env=_env(site))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads(result.stdout)["draft"] == "good"
    result = run_cli("resolve", "--json", "--attention-backend", "torch_native", path_entries=[site], env=_env(site))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["draft"] == "flashinfer"
    assert "plugin 'exiting_fallback': hook attnhost_draft_fallback('cpu') raised SystemExit: no" in result.stderr


def test_the_api_never_raises_for_a_broken_plugin(site: Path) -> None:
    code = (
        "import attnhost\n"
        "registry = attnhost.get_registry()\n"
        "args = attnhost.ServerArgs(attention_backend='good')\n"
        "print(attnhost.resolve_draft_attention_backend(args, platform='cpu').name, 'good' in registry)\n"
    )
    result = run_python(code, path_entries=[site], env=_env(site))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["good", "True"]
    assert "Traceback" not in result.stderr


def test_in_process_hook_failures_do_not_escape(caplog: pytest.LogCaptureFixture) -> None:
    class Raising:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[attnhost.BackendSpec]:
            raise KeyError("oops")

    class Fine:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[attnhost.BackendSpec]:
            return [attnhost.BackendSpec(name="fine", factory="fine_mod:B")]

    attnhost.register_plugin(Raising(), name="raising")
    attnhost.register_plugin(Fine(), name="fine-plugin")
    registry = attnhost.get_registry()
    assert "fine" in registry
    attnhost.add_attention_backend_choices(["later"])  # a rebuild must not warn a second time
    assert "later" in attnhost.get_registry()
    messages = [r.getMessage() for r in caplog.records if "raising" in r.getMessage()]
    assert len(messages) == 1 and "KeyError: 'oops'" in messages[0]
    status = {p.name: p.status.value for p in attnhost.host.default_host().plugins()}
    assert status["raising"] == "failed" and status["fine-plugin"] == "loaded"
