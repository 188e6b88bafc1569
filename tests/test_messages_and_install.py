"""Messages about installing and loading, as a newcomer meets them: one torch advice, one JSON shape, prose that fits
the terminal, a plugin problem said once, a broken install named as such, a failed plugin named before a near name.

Real environments: this one's site-packages as links less torch (or less ``importlib_metadata``), run with
``python -S``; real plugin distributions (``distgen``); the CLI in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import importlib_metadata
import pytest
from helpers import README, flat, make_plugin, reader_pages, run_cli, subprocess_env

from attnhost.platform import TORCH_HINT

CPU_INDEX = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
BROKEN = "raise RuntimeError('vendor kernels are not built')\n"


def _site_without(root: Path, *prefixes: str) -> Path:
    """This environment's site-packages as links, less the entries named ``prefixes``: a real installation in which
    those packages are missing."""
    root.mkdir()
    site_packages = Path(importlib_metadata.__file__).parents[1]
    for item in site_packages.iterdir():
        if not item.name.lower().startswith(prefixes):
            os.symlink(item, root / item.name)
    return root


def _cli(
    site: Path, *args: str, env: dict[str, str] | None = None, path_entries: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``attnhost ARGS`` with ``site`` as the only site-packages (``PYTHONPATH`` still first: the sources tested)."""
    code = f"import sys; sys.path.append({str(site)!r}); from attnhost.cli import main; sys.exit(main())"
    environ = subprocess_env(path_entries, {"ATTNHOST_PLATFORM": "cpu", **(env or {})})
    return subprocess.run(
        [sys.executable, "-S", "-c", code, *args], capture_output=True, text=True, env=environ, timeout=120
    )


@pytest.fixture(scope="module")
def torchless(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _site_without(tmp_path_factory.mktemp("torchless") / "site", "torch")


def _words(text: str) -> list[str]:
    return text.split()


def test_every_torch_advice_is_the_cpu_build_one(torchless: Path, tmp_path: Path) -> None:
    assert CPU_INDEX in TORCH_HINT
    shown = _cli(torchless, "list", "torch_native", "--wide")
    assert shown.returncode == 0, shown.stderr
    assert f"module 'torch' is not installed: {TORCH_HINT}" in shown.stdout, shown.stdout
    assert "(pip install torch)" not in shown.stdout
    table = _cli(torchless, "list", "--wide")
    assert TORCH_HINT in table.stdout and "(pip install torch)" not in table.stdout
    # A third-party backend that needs torch gets the same advice, not "reinstall acme-attn".
    source = (
        "import attnhost\n\n@attnhost.hookimpl\ndef attnhost_attention_backends():\n"
        "    return [attnhost.BackendSpec(name='acme', factory='acme_attn_k:Acme', requires=('torch',))]\n"
    )
    make_plugin(tmp_path, "acme-attn", "1.0", "acme", "acme_attn", source)
    (tmp_path / "acme_attn_k.py").write_text("class Acme: ...\n")
    acme = _cli(torchless, "list", "acme", "--json", path_entries=(tmp_path,))
    assert json.loads(acme.stdout)["backend"]["reason"] == f"module 'torch' is not installed: {TORCH_HINT}"


def test_the_docs_give_the_same_advice_and_say_what_a_fresh_machine_does() -> None:
    front = flat(README.read_text(encoding="utf-8"))  # the two commands' section says it, where a newcomer starts
    assert CPU_INDEX in front
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu tox" in front
    installs = []
    for page, text in reader_pages().items():
        blocks = re.findall(r"```(?:bash|console)\n(.*?)```", text, re.S)
        commands = [line.split("  #")[0] for block in blocks for line in block.splitlines() if not line.startswith("#")]
        installs += [(page, line) for line in commands if re.search(r"pip install torch\b", line)]
    assert installs, "the docs lost their torch install commands"
    for page, line in installs:  # a pin alone, from PyPI, is the CUDA build
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, f"{page}: {line}"


def test_list_available_json_has_one_shape_with_and_without_torch(torchless: Path) -> None:
    without = _cli(torchless, "list", "--available", "--json")
    assert without.returncode == 0 and without.stderr == "", without.stderr
    data = json.loads(without.stdout)
    assert isinstance(data, dict) and set(data) == {"platform", "backends", "plugins", "notes"}, data
    assert data["backends"] == [] and data["platform"] == "cpu"
    assert data["notes"] == [f"nothing can run on platform cpu until torch is installed: {TORCH_HINT}"]
    assert [p["name"] for p in data["plugins"]] == ["builtin"]
    full = json.loads(run_cli("list", "--json", env={"ATTNHOST_PLATFORM": "cpu"}).stdout)
    assert set(full) == set(data) and full["notes"] == []


@pytest.mark.parametrize("columns", [80, 50])
def test_prose_wraps_at_word_boundaries_to_the_terminal(torchless: Path, columns: int) -> None:
    wide = _cli(torchless, "list", "--available", "--wide")
    assert len(wide.stdout.splitlines()) == 1  # --wide: one line, however long
    narrow = _cli(torchless, "list", "--available", env={"COLUMNS": str(columns)})
    assert narrow.returncode == 0 and narrow.stderr == "", narrow.stderr
    lines = narrow.stdout.splitlines()
    assert len(lines) > 1 and all(len(line) <= columns for line in lines), narrow.stdout
    assert _words(narrow.stdout) == _words(wide.stdout)  # no word cut in two, none lost
    note = _cli(torchless, "list", "torch_native", env={"COLUMNS": str(columns)})
    assert all(len(line) <= columns for line in note.stdout.splitlines()), note.stdout
    if columns >= 80:  # a column narrower than a word must cut it; 80 columns leave room for the whole address
        assert "https://download.pytorch.org/whl/cpu," in _words(note.stdout), note.stdout


def test_strict_mode_prints_a_plugin_problem_once(tmp_path: Path) -> None:
    make_plugin(tmp_path, "vendorx-kernels", "1.0", "vendorx", "vendorx_attn", BROKEN)
    relaxed = run_cli("list", path_entries=[tmp_path])
    assert relaxed.returncode == 0
    assert [line for line in relaxed.stderr.splitlines() if "vendor kernels are not built" in line] == [
        relaxed.stderr.strip()
    ]
    assert relaxed.stderr.startswith("attnhost: warning: plugin 'vendorx' (distribution vendorx-kernels 1.0)")
    for env in ({"ATTNHOST_STRICT": "1"}, {"ATTNHOST_STRICT": "1", "ATTNHOST_PLUGINS": "vendorx,vendorz"}):
        strict = run_cli("list", path_entries=[tmp_path], env=env)
        assert strict.returncode == 1
        lines = strict.stderr.splitlines()
        assert len(lines) == 1, strict.stderr
        assert lines[0].startswith("attnhost: error: ATTNHOST_STRICT=1") and "vendor kernels are not built" in lines[0]
    # The names of ATTNHOST_PLUGINS that are not installed keep their hint inside the one error.
    assert "names plugin 'vendorz', which is not installed (did you mean 'vendorx'?)" in strict.stderr


def test_a_missing_dependency_of_attnhost_is_one_line_naming_it_and_the_fix(tmp_path: Path) -> None:
    site = _site_without(tmp_path / "site", "importlib_metadata")
    result = _cli(site, "list", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})  # no cache: the scan needs it
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("attnhost: error: attnhost cannot look up installed plugins: "), result.stderr
    assert "No module named 'importlib_metadata'" in result.stderr
    assert "pip install 'importlib-metadata>=8'" in result.stderr
    assert "internal error" not in result.stderr


def test_an_unknown_name_mentions_the_plugins_that_failed_before_a_near_name(tmp_path: Path) -> None:
    make_plugin(tmp_path, "vendorx-kernels", "1.0", "vendorx", "vendorx_attn", BROKEN)
    result = run_cli("list", "acme", path_entries=[tmp_path])
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    failed = error.index("plugin 'vendorx' (distribution vendorx-kernels 1.0) failed to load and may provide it")
    assert failed < error.index("did you mean 'ascend'?"), error
    far = run_cli("list", "qqqq", path_entries=[tmp_path]).stderr.strip().splitlines()[-1]
    assert "plugin 'vendorx'" in far and far.index("plugin 'vendorx'") < far.index("choose from:"), far
    # Without a failed plugin, the near name alone, as before.
    clean = run_cli("list", "acme")
    assert clean.stderr == "attnhost: error: unknown attention backend 'acme'; did you mean 'ascend'?\n"


PAGED_PLUGIN = (
    "import attnhost\n\n@attnhost.hookimpl\ndef attnhost_attention_backends():\n"
    "    return [attnhost.BackendSpec(name='acme_paged', factory='acme_paged_k:AcmePaged', requires=('torch',),\n"
    "                                 description='pages of 16, bf16, graphs'),\n"
    "            attnhost.BackendSpec(name='acme_typo', factory='acme_paged_k:AcmePagd', description='a typo')]\n"
)
PAGED_KERNEL = '''
from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class AcmePaged(TorchNativeAttnBackend):
    """acme's paged kernel (test plugin)."""

    capabilities = BackendCapabilities(dtypes=("bfloat16",), head_dims=(64, 128), page_sizes=(16,), cuda_graph=True)
'''


@pytest.mark.torch
def test_list_name_shows_every_capability_the_backend_declares(tmp_path: Path) -> None:
    """Before, the only way to see them was which kit tests skipped."""
    pytest.importorskip("torch")
    make_plugin(tmp_path, "acme-paged", "1.0", "acme", "acme_paged_p", PAGED_PLUGIN)
    (tmp_path / "acme_paged_k.py").write_text(PAGED_KERNEL)
    shown = run_cli("list", "acme_paged", "--wide", path_entries=[tmp_path], env={"ATTNHOST_PLATFORM": "cpu"})
    assert shown.returncode == 0, shown.stderr
    facts = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in shown.stdout.splitlines() if "  " in line)
    assert facts["dtypes"] == "bfloat16" and facts["head dims"] == "64, 128" and facts["page sizes"] == "16"
    assert facts["cache dtypes"] == "its dtypes (no FP8)" and facts["declares"] == "graphs"
    assert facts["not declared"] == "trees, MLA, windows, soft-caps, sinks, non-causal, flat heads"
    data = json.loads(run_cli("list", "acme_paged", "--json", path_entries=[tmp_path]).stdout)["backend"]
    assert data["capabilities"]["page_sizes"] == [16] and data["capabilities"]["cuda_graph"] is True
    assert data["capabilities"]["head_dims"] == [64, 128] and data["capabilities_unread"] is None
    typo = json.loads(run_cli("list", "acme_typo", "--json", path_entries=[tmp_path]).stdout)["backend"]
    assert typo["capabilities"] is None and typo["capabilities_unread"].startswith("could not be read: "), typo
    assert "AcmePagd" in typo["capabilities_unread"], typo
