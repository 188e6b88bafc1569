"""The CLI says things one way: hints, prefixes, alignment, bounded echoes, names.

Real distributions (``distgen``), the CLI in a fresh interpreter; the torch-less run uses a real environment
without torch: ``python -S`` on a directory linking only what ``attnhost list`` needs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import importlib_metadata
import pytest
from distgen import make_dist
from helpers import GROUP, make_plugin, run_cli, subprocess_env


def test_a_mistyped_command_gets_a_hint_and_every_error_one_prefix() -> None:
    typo = run_cli("lsit")
    assert typo.returncode == 2
    assert typo.stderr == "attnhost: error: unknown command 'lsit'; did you mean 'list'? (see `attnhost --help`)\n"
    other = run_cli("frobnicate")
    assert other.stderr.startswith(
        "attnhost: error: unknown command 'frobnicate'; choose from: list, plugins, versions, resolve"
    )
    flag = run_cli("resolve", "--bogus")
    assert flag.returncode == 2
    assert flag.stderr == "attnhost: error: unrecognized arguments: --bogus (see `attnhost resolve --help`)\n"
    choice = run_cli("resolve", "--attention-backend", "nope")
    assert choice.returncode == 2 and choice.stderr.startswith("attnhost: error: "), choice.stderr


def _torchless_site(root: Path) -> Path:
    """This environment's site-packages as links, less torch: a real installation in which torch is missing."""
    root.mkdir()
    site_packages = Path(importlib_metadata.__file__).parents[1]
    for item in site_packages.iterdir():
        if not item.name.lower().startswith("torch"):
            os.symlink(item, root / item.name)
    return root


def test_list_available_without_torch_says_only_how_to_install_it(tmp_path: Path) -> None:
    site = _torchless_site(tmp_path / "site")
    code = f"import sys; sys.path.append({str(site)!r}); from attnhost.cli import main; sys.exit(main())"
    args = [sys.executable, "-S", "-c", code, "list", "--available"]
    env = subprocess_env((), {"ATTNHOST_PLATFORM": "cpu"})
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert all(len(line) <= 80 for line in result.stdout.splitlines()), result.stdout  # wrapped, as all prose
    assert " ".join(result.stdout.split()).startswith(
        "nothing can run on platform cpu until torch is installed: pip install 'attnhost[torch]'"
    )


def test_columns_stay_aligned_on_an_ascii_stdout(tmp_path: Path) -> None:
    make_dist(
        tmp_path,
        "acme-attn",
        "1.0",
        {GROUP: {"acme": "acme_attn_a9"}},
        modules={
            "acme_attn_a9": "import attnhost\n\n@attnhost.hookimpl\ndef attnhost_attention_backends():\n    return []\n"
        },
        metadata_name="Äcme-Ättn",
    )
    result = run_cli("plugins", path_entries=[tmp_path], env={"PYTHONIOENCODING": "ascii", "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    column = header.index("STATUS")
    acme = next(row for row in rows if row.startswith("acme"))
    assert "\\xc4cme-\\xc4ttn" in acme, acme
    assert acme[column:].startswith("loaded"), result.stdout


def test_echoed_outside_text_is_bounded(tmp_path: Path) -> None:
    long_name = "x" * 100_000
    result = run_cli("list", long_name)
    assert result.returncode == 2 and len(result.stderr) < 1_000, len(result.stderr)
    assert "(100,002 characters)" in result.stderr  # its repr, quotes included
    names = ",".join(f"{i:x}" for i in range(20_000))  # 98 kB: one environment string holds at most 128 kB
    many = run_cli("list", env={"ATTNHOST_PLUGINS": names})
    assert many.returncode == 0 and len(many.stderr) < 5_000, len(many.stderr)
    assert "names 19995 more plugins that are not installed" in many.stderr
    strict = run_cli("list", env={"ATTNHOST_PLUGINS": names, "ATTNHOST_STRICT": "1"})
    assert strict.returncode == 1 and len(strict.stderr) < 5_000, len(strict.stderr)
    assert "and 19995 more names of ATTNHOST_PLUGINS" in strict.stderr


def test_a_distribution_without_a_name_is_shown_by_its_metadata_directory(tmp_path: Path) -> None:
    meta = make_plugin(tmp_path, "noname-attn", "1.0", "noname", "noname_attn_a11", "")
    text = (meta / "METADATA").read_text()
    (meta / "METADATA").write_text("".join(line for line in text.splitlines(True) if not line.startswith("Name:")))
    result = run_cli("plugins", "--wide", path_entries=[tmp_path])
    row = next(line for line in result.stdout.splitlines() if line.startswith("noname"))
    assert "(in-process)" not in row and f"{meta} (no Name in METADATA)" in row, result.stdout


def test_a_cache_hit_repeats_the_unreadable_metadata_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from distgen import settle

    from attnhost import entry_points as E

    make_dist(tmp_path, "good", "1.0", {GROUP: {"good": "good_mod"}})
    bad = make_dist(tmp_path, "bad", "1.0", {GROUP: {"bad": "bad_mod"}})
    (bad / "entry_points.txt").write_bytes(b"[" + GROUP.encode() + b"]\nbad = \xff\xfe\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(E, "RACY_WINDOW_NS", 50_000_000)
    settle(50_000_000)
    E.clear_memo()
    for _ in range(2):
        E.clear_memo()  # the second scan may read the cache file: it must say what the first said
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="attnhost"):
            assert [r.name for r in E.scan(GROUP) if r.name in ("good", "bad")] == ["good"]
        assert [r for r in caplog.records if "bad 1.0" in r.getMessage() and "unreadable metadata" in r.getMessage()]
    E.clear_memo()
