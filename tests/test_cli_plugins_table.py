"""``attnhost plugins`` at 80 columns: the plugin and distribution names are what an operator copies into
``ATTNHOST_PLUGINS`` or ``pip uninstall``, so they are never cut; the backends and entry point give way instead.

The plugins are real installed distributions (``distgen``) and the CLI runs in a fresh interpreter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import GROUP, make_plugin, run_cli

NARROW = {"COLUMNS": "80", "ATTNHOST_PLATFORM": "cpu"}
LONG_PLUGIN = "acme_accelerated_attention_kernels"  # too long to share a line with the distribution
LONG_DIST = "acme-accelerated-attention-kernels-for-datacenter-gpus"
MID_PLUGIN = "vendorx_paged"  # long, but it and its distribution fit on one line
MID_DIST = "vendorx-paged-kernels"

_HOOKS = """\
import attnhost


@attnhost.hookimpl
def attnhost_attention_backends():
    factory = "attnhost_builtin.torch_native:X"
    return [attnhost.BackendSpec(name=f"PREFIX_kernel_{i}", factory=factory) for i in range(22)]
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    for plugin, dist, module, prefix in (
        (LONG_PLUGIN, LONG_DIST, "acme_accelerated_attention_kernels_entry", "acme"),
        (MID_PLUGIN, MID_DIST, "vendorx_paged_kernels_entry_point", "vendorx"),
    ):
        make_dist(root, dist, "12.4.1", {GROUP: {plugin: module}}, modules={module: _HOOKS.replace("PREFIX", prefix)})
    make_plugin(root, "broken-attn", "2.0", "broken", "broken_attn", "raise ImportError('libbroken.so.1 missing')\n")
    return root


def test_plugins_at_80_columns_keeps_plugin_and_distribution_names_whole(site: Path) -> None:
    result = run_cli("plugins", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert not [line for line in out.splitlines() if len(line) > 80], out
    # each name whole, as a word of its own: copy-pasteable
    for name in (LONG_PLUGIN, f"{LONG_DIST} 12.4.1", MID_PLUGIN, f"{MID_DIST} 12.4.1", "broken-attn 2.0"):
        assert re.search(rf"(^| ){re.escape(name)}( |$)", out, re.M), (name, out)
    # names that fit share their row's line; the shorter columns gave way, cut and marked
    mid = re.search(rf"^{MID_PLUGIN} +{MID_DIST} 12\.4\.1 +loaded +(\S+) +(\S+)$", out, re.M)
    assert mid, out
    assert mid.group(1).startswith("vendorx_k") and mid.group(1).endswith("..."), out
    # a name too long to share its line: printed in full, the rest of the row continues below, under its columns
    header, *lines = out.splitlines()
    first = lines.index(LONG_PLUGIN)
    assert lines[first + 1].strip() == f"{LONG_DIST} 12.4.1", out
    assert lines[first + 1].index(LONG_DIST) == header.index("DISTRIBUTION"), out
    assert lines[first + 2].index("loaded") == header.index("STATUS"), out
    assert re.search(r"^broken +broken-attn 2\.0 +failed +- +broken_attn$", out, re.M), out


def test_plugins_wide_is_one_line_a_plugin(site: Path) -> None:
    wide = run_cli("plugins", "--wide", path_entries=[site], env=NARROW).stdout
    row = next(line for line in wide.splitlines() if line.startswith(LONG_PLUGIN + " "))
    assert f" {LONG_DIST} 12.4.1 " in row and row.endswith(" acme_accelerated_attention_kernels_entry"), wide
    assert ",acme_kernel_21 " in row, row  # every backend, in full


def test_fit_table_keeps_whole_columns_whole() -> None:
    from attnhost.terminal import fit_table

    rows = [["NAME", "DIST", "NOTE"], ["n" * 30, "d" * 45, "x" * 30], ["short", "dist", "note"]]
    lines = fit_table(rows, 60, flexible=(2,), whole=(0, 1), wrap_last=False)
    assert all(len(line) <= 60 for line in lines), lines
    assert "n" * 30 in lines[1] and any("d" * 45 in line for line in lines), lines
    assert lines[-1].split() == ["short", "dist", "note"], lines
    assert fit_table(rows, None, whole=(0, 1)) == fit_table(rows, None)  # unbounded: the --wide layout, unchanged


def test_list_at_80_columns_keeps_backend_and_plugin_names_whole(site: Path) -> None:
    """``attnhost list``'s NAME and PLUGIN columns are what a user passes to ``--attention-backend`` and
    ``ATTNHOST_PLUGINS``: never cut either."""
    result = run_cli("list", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "..." not in out and not [line for line in out.splitlines() if len(line) > 80], out
    for name in ("acme_kernel_21", LONG_PLUGIN, "vendorx_kernel_3", MID_PLUGIN):
        assert re.search(rf"(^| ){re.escape(name)}( |$)", out, re.M), (name, out)
