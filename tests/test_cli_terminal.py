"""The CLI as an operator meets it: output that fits an 80-column terminal, help that explains, safe plugin text.

Every command runs in a fresh interpreter against real plugin distributions
(``distgen``); ``COLUMNS`` sets the width exactly as a terminal would.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import GROUP, make_plugin, run_cli, subprocess_env

NARROW = {"COLUMNS": "80", "ATTNHOST_PLATFORM": "cpu"}

_SHORTHAND = '''\
"""A shorthand plugin: the class's docstring is its description."""
from attnhost import AttentionBackend


class Backend(AttentionBackend):
    """DESCRIPTION"""

    def init_forward_metadata(self, forward_batch):
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        raise NotImplementedError
'''

_HOOKS = """\
import attnhost


@attnhost.hookimpl
def attnhost_attention_backends():
    return [
        attnhost.BackendSpec(
            name="acme_very_long_backend_name_for_wide_tables",
            factory="acme_kernels:Backend",
            aliases=("acme_alias_one", "acme_alias_two"),
            platforms=("cuda",),
            description="ACME attention with a description long enough to wrap any table " * 2,
        ),
        attnhost.BackendSpec(name="acme_cpu", factory="acme_kernels:Backend", aliases=("acme_c",)),
    ]


@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["acme_cpu"]
"""

_KERNELS = "from attnhost_tests_shorthand import Backend\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plugin with long names and aliases, a working shorthand, and a plugin whose import fails at length."""
    root = tmp_path_factory.mktemp("site")
    make_dist(
        root,
        "acme-attn",
        "1.0",
        {GROUP: {"acme": "acme_attn"}},
        modules={
            "acme_attn": _HOOKS,
            "acme_kernels": _KERNELS,
            "attnhost_tests_shorthand": _SHORTHAND.replace("DESCRIPTION", "A shorthand backend."),
        },
    )
    make_plugin(
        root,
        "broken-attn",
        "2.0",
        "broken",
        "broken_attn",
        "raise ImportError('the vendor library libacme.so.3 could not be found in any of the directories "
        "on LD_LIBRARY_PATH; install acme-runtime or set ACME_HOME to its prefix')\n",
    )
    return root


def _assert_fits(text: str, width: int = 80) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, "\n".join(too_wide)


# -- 80 columns ----------------------------------------------------------------------------------


def test_list_fits_80_columns_and_groups_the_reasons(site: Path) -> None:
    result = run_cli("list", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    _assert_fits(out)
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ROLES", "PLUGIN", "AVAILABLE"]
    # 20 declared-only built-ins share one numbered note instead of repeating the reason on every row
    note = re.search(r"^\[(\d+)\] declared only: no installed plugin implements it$", out, re.M)
    assert note, out
    assert out.count("declared only") == 1
    assert len(re.findall(rf"  no \[{note.group(1)}\]$", out, re.M)) >= 19
    # names are never cut (a user passes them to --attention-backend): the long one whole, its row fitting
    assert "..." not in out, out
    # too long to share its line: whole, with its aliases, and the rest of its row below, under its columns
    long_name = re.search(
        r"^acme_very_long_backend_name_for_wide_tables \(acme_alias_one, acme_alias_two\)\n +target +acme +no \[\d+\]$",
        out,
        re.M,
    )
    assert long_name, out
    assert re.search(r"^acme_cpu \(acme_c\) +target,draft +acme +yes$", out, re.M), out
    assert re.search(r"^\[\d+\] runs on cuda, not cpu$", out, re.M), out
    assert "1 plugin(s) failed to load: see `attnhost plugins`" in out


def test_declared_only_names_no_misleading_kernel_hint(site: Path) -> None:
    """flex_attention's kernels are torch's, and torch is installed: the reason must not read as "install torch"."""
    result = run_cli("list", "flex_attention", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    assert "(kernels: torch)" not in result.stdout
    text = " ".join(result.stdout.split())
    assert "no: declared only: no installed plugin implements it" in text


def test_wide_shows_every_column_in_full(site: Path) -> None:
    result = run_cli("list", "--wide", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["NAME", "ROLES", "PLUGIN", "DISTRIBUTION", "IMPLEMENTED", "AVAILABLE", "DESCRIPTION"]
    row = next(r for r in rows if r.startswith("acme_very_long_backend_name_for_wide_tables "))
    assert "(acme_alias_one, acme_alias_two)" in row and "acme-attn 1.0" in row
    assert "no: runs on cuda, not cpu" in row and row.endswith("any table")
    assert max(map(len, rows)) > 80


def test_list_name_shows_one_backend_in_full(site: Path) -> None:
    result = run_cli("list", "acme_alias_two", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    _assert_fits(out)
    assert re.search(r"^name +acme_very_long_backend_name_for_wide_tables$", out, re.M)
    assert re.search(r"^aliases +acme_alias_one, acme_alias_two$", out, re.M)
    assert re.search(r"^plugin +acme \(acme-attn 1\.0\)$", out, re.M)
    assert re.search(r"^on cpu +no: runs on cuda, not cpu$", out, re.M)
    # the long description wraps under itself
    description = re.search(r"^description +(.*(?:\n {13}.*)*)", out, re.M)
    assert description and " ".join(description.group(1).split()).endswith("wrap any table"), out
    data = json.loads(run_cli("list", "acme_c", "--json", path_entries=[site], env=NARROW).stdout)
    assert data["backend"]["name"] == "acme_cpu" and data["backend"]["available"] is True


def test_list_unknown_name_is_one_line_with_did_you_mean(site: Path) -> None:
    result = run_cli("list", "acme_cpuu", path_entries=[site], env=NARROW)
    assert result.returncode == 2 and result.stdout == ""
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("attnhost: error: unknown attention backend 'acme_cpuu'; "), error
    assert error.endswith("failed to load and may provide it (see `attnhost plugins`); did you mean 'acme_cpu'?")
    assert "plugin 'broken' (distribution broken-attn 2.0)" in error  # the site's broken plugin, named first


@pytest.mark.torch  # needs torch installed (the py312/py313 envs have none)
def test_available_shows_only_what_runs_here(site: Path) -> None:
    result = run_cli("list", "--available", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()[1:] if line and not line.startswith("[")]
    assert names[:2] == ["torch_native", "acme_cpu"], result.stdout
    assert "2 backend(s) can run on platform cpu" in result.stdout
    data = json.loads(run_cli("list", "--available", "--json", path_entries=[site], env=NARROW).stdout)
    assert {row["name"] for row in data["backends"]} == {"torch_native", "acme_cpu"}
    draft = json.loads(run_cli("list", "--available", "--draft", "--json", path_entries=[site], env=NARROW).stdout)
    assert [row["name"] for row in draft["backends"]] == ["acme_cpu"]


def test_plugins_fits_80_columns_with_the_error_below(site: Path) -> None:
    result = run_cli("plugins", path_entries=[site], env=NARROW)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    _assert_fits(out)
    assert re.search(r"^broken +broken-attn 2\.0 +failed +- +broken_attn$", out, re.M), out
    error = re.search(r"^broken: (.*(?:\n    .*)*)", out, re.M)
    assert error, out
    assert " ".join(error.group(1).split()).endswith("set ACME_HOME to its prefix")
    wide = run_cli("plugins", "--wide", path_entries=[site], env=NARROW).stdout
    assert re.search(r"^broken .*broken_attn: importing 'broken_attn' raised ImportError: .*prefix$", wide, re.M)


def test_resolve_fits_80_columns_and_prints_each_warning_once(site: Path) -> None:
    result = run_cli(
        "resolve", "--attention-backend", "torch_native", "--platform", "rocm", path_entries=[site], env=NARROW
    )
    assert result.returncode == 0, result.stderr
    _assert_fits(result.stdout)
    both = result.stdout + result.stderr
    assert both.count("draft worker only supports") == 1, both
    assert re.search(r"^  4\. draft: 'torch_native' is not draft-capable", result.stdout, re.M)
    assert re.search(r"^     \S", result.stdout, re.M), "a long trace step wraps under its text"


# -- help and defaults -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["list", "plugins", "resolve"])
def test_subcommand_help_describes_and_names_the_environment(command: str) -> None:
    result = run_cli(command, "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    _assert_fits(out)
    description = out.split("\n\n")[1]
    assert len(description.split()) > 12, out  # a sentence or more, not just the usage line
    assert "environment variables:" in out
    for name in ("ATTNHOST_PLUGINS", "ATTNHOST_STRICT", "ATTNHOST_DISABLE_PLUGIN_AUTOLOAD"):
        assert f"\n  {name}\n" in out, out
    assert ("ATTNHOST_PLATFORM" in out) == (command != "plugins")


def test_no_command_runs_list() -> None:
    alone = run_cli(env=NARROW)
    listed = run_cli("list", env=NARROW)
    assert alone.returncode == listed.returncode == 0, alone.stderr
    assert alone.stdout == listed.stdout and alone.stdout.startswith("NAME")
    with_flag = run_cli("--available", "--json", env=NARROW)
    assert with_flag.returncode == 0, with_flag.stderr
    assert with_flag.stdout == run_cli("list", "--available", "--json", env=NARROW).stdout
    bad = run_cli("--bogus", env=NARROW)
    assert bad.returncode == 2
    assert bad.stderr == "attnhost: error: unrecognized arguments: --bogus (see `attnhost list --help`)\n"


def test_unknown_flag_points_at_the_commands_own_help() -> None:
    result = run_cli("plugins", "--bogus", env=NARROW)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "attnhost: error: unrecognized arguments: --bogus (see `attnhost plugins --help`)\n"


def test_draft_flag_offers_the_draft_capable_names_with_aliases(site: Path) -> None:
    result = run_cli("resolve", "--help", path_entries=[site], env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    offered = text.split("draft-capable: ", 1)[1].split(" --speculative-attention-mode")[0]
    assert offered == "flashinfer, fa3, fa4, triton, ascend, trtllm_mha, intel_xpu, acme_cpu (alias acme_c)"
    target = text.split("prefill and decode; choices: ", 1)[1].split(" --prefill-attention-backend")[0]
    assert "dsa (alias nsa)" in target and "torch_native" in target
    # aliases are accepted where they are offered
    resolved = run_cli(
        "resolve", "--speculative-draft-attention-backend", "acme_c", "--json", path_entries=[site], env=NARROW
    )
    assert json.loads(resolved.stdout)["draft"] == "acme_cpu", resolved.stderr


# -- plugin text cannot hurt -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Escape sequences and non-ASCII text in every place a plugin controls."""
    root = tmp_path_factory.mktemp("hostile")
    make_dist(
        root,
        "evil-dist",
        "1.0\x1b[31m",
        {GROUP: {"evil\x1b[2Jname": "evil_mod:Backend"}},
        modules={"evil_mod": _SHORTHAND.replace("DESCRIPTION", "broken")},
        metadata_name="evil\x1b]0;title\x07dist",
    )
    make_dist(
        root,
        "pretty-dist",
        "1.0",
        {GROUP: {"pretty": "pretty_mod:Backend"}},
        modules={"pretty_mod": _SHORTHAND.replace("DESCRIPTION", "Caf\\u00e9 kernels \\x1b[2J for \\u2603")},
    )
    make_plugin(root, "raiser", "1.0", "raiser", "raiser_mod", "raise RuntimeError('boom \\x1b[2J caf\\u00e9')\n")
    return root


@pytest.mark.parametrize("command", [["list", "--wide"], ["list", "pretty"], ["plugins"], ["plugins", "--wide"]])
def test_control_characters_are_escaped(hostile_site: Path, command: list[str]) -> None:
    result = run_cli(*command, path_entries=[hostile_site], env=NARROW)
    assert result.returncode == 0, result.stderr
    for stream in (result.stdout, result.stderr):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", stream), repr(stream)
    shown = result.stdout + result.stderr
    assert "\\x1b[2J" in shown
    if command[0] == "plugins":
        assert "evil\\x1b[2Jname" in result.stdout
        assert "1.0\\x1b[31m" in (result.stdout if "--wide" in command else result.stderr)
        assert "boom \\x1b[2J café" in " ".join(result.stdout.split())


def test_non_ascii_on_an_ascii_stdout_becomes_escapes(hostile_site: Path) -> None:
    result = run_cli("list", "--wide", path_entries=[hostile_site], env={**NARROW, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "Caf\\xe9 kernels \\x1b[2J for \\u2603" in result.stdout
    assert result.stdout.rstrip().endswith("see `attnhost plugins`"), "the table and its summary are complete"
    result = run_cli("plugins", path_entries=[hostile_site], env={**NARROW, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "caf\\xe9" in result.stdout


def _shell(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        env=subprocess_env(env=NARROW),
        timeout=120,
    )


def test_closed_stdout_is_one_write_error_line() -> None:
    result = _shell(f"'{sys.executable}' -m attnhost list >&-")
    assert result.returncode == 1
    assert result.stderr == "attnhost: write error: standard output is closed\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["list", "plugins --json", "resolve"])
def test_full_stdout_is_one_write_error_line(command: str) -> None:
    result = _shell(f"'{sys.executable}' -m attnhost {command} > /dev/full")
    assert result.returncode == 1
    assert result.stderr == "attnhost: write error: cannot write the output: No space left on device\n"


def test_a_reader_that_leaves_early_gets_no_noise() -> None:
    result = _shell(f"'{sys.executable}' -m attnhost list --wide | head -n 1")
    assert result.returncode == 0
    assert result.stdout.startswith("NAME") and result.stdout.count("\n") == 1
    assert result.stderr == ""


# -- the layout itself ---------------------------------------------------------------------


def test_fit_table_never_exceeds_the_width() -> None:
    from attnhost.terminal import fit_table

    rows = [["NAME", "NOTE"], ["a" * 50, "b " * 60], ["short", "x"]]
    for width in (40, 60, 80, 120):
        lines = fit_table(rows, width, flexible=(0,))
        assert all(len(line) <= width for line in lines), (width, lines)
        assert lines[0].startswith("NAME")
    narrow = fit_table(rows, 60, flexible=(0,))
    assert narrow[1].startswith("a" * 10) and "..." in narrow[1]  # the flexible column was cut, marked
    assert " ".join(" ".join(narrow[1:-1]).split()).count("b") == 60  # the last column wrapped, nothing lost
    assert fit_table(rows)[1] == "a" * 50 + "  " + ("b " * 60).rstrip()  # unbounded: the --wide layout


def test_fit_table_escapes_control_characters() -> None:
    from attnhost.terminal import fit_table

    lines = fit_table([["NAME"], ["x\x1b[2Jy"]], 80)
    assert lines == ["NAME", "x\\x1b[2Jy"]
