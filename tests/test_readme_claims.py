"""What the README and the docs show is what a reader gets: the commands' outputs they print, the plugin guide's
install steps and the errors it quotes, and no timing without the benchmark that measures it.

The quoted errors come from a real editable install (``pip install -e``) of a copy of this checkout named
``attnhost``, run from the directory holding it, in an environment whose only attnhost is that install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import importlib_metadata
import pytest
from helpers import ROOT, flat, plugin_guide, reader_pages, run_cli, subprocess_env


def _shown_outputs() -> list[tuple[str, str, str]]:
    """(page, command, output) for every ``$ attnhost ...`` line of a console block that is followed by its output;
    an output holding ``...`` is an excerpt, not a whole output, and is left out."""
    shown = []
    for page, text in reader_pages().items():
        for block in re.findall(r"```console\n(.*?)```", text, re.S):
            for match in re.finditer(r"^\$ (attnhost .*?)(?:\s+#.*)?\n((?:(?!\$ ).*\n)+)", block, re.M):
                if "..." not in match.group(2):
                    shown.append((page, match.group(1), match.group(2)))
    return shown


def test_the_outputs_shown_are_what_the_commands_print() -> None:
    pytest.importorskip("torch")  # the examples are run with torch installed, on a CPU
    shown = _shown_outputs()
    commands = {command for _, command, _ in shown}
    assert "attnhost resolve --attention-backend torch_native --platform rocm" in commands, commands
    assert any(page == "README.md" for page, _, _ in shown), "the front page's session shows no output"
    for page, command, output in shown:
        result = run_cli(*command.split()[1:], env={"COLUMNS": "80", "ATTNHOST_PLATFORM": "cpu"})
        assert result.returncode == 0, result.stderr
        assert result.stdout == output, (
            f"{page}: `{command}` is not what the command prints at 80 columns; paste its output:\n{result.stdout}"
        )


def test_the_plugin_guide_installs_from_the_plugins_own_directory() -> None:
    guide = plugin_guide()
    block = re.search(r"```bash\n(.*?)```", guide[guide.index("## Install order") :], re.S)
    assert block, "the plugin guide lost its install block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    commands = [command for command in commands if command]
    assert "cd acme-attn" in commands and "pip install -e ." in commands, commands
    assert commands.index("cd acme-attn") < commands.index("pip install -e .")
    assert not [c for c in commands if "./acme-attn" in c or "../" in c], commands  # nothing relative to elsewhere


def test_no_timing_without_the_benchmark_that_measures_it() -> None:
    for page, text in reader_pages().items():
        for paragraph in text.split("\n\n"):
            figures = re.findall(r"\b\d+(?:\.\d+)?(?:-\d+)?\s?(?:ms|s|min)\b", paragraph)
            assert not figures or "benchmarks/" in paragraph, f"{page}: {figures} measured where and how? {paragraph}"


def _editable_checkout(tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of this checkout named ``attnhost``, installed with ``pip install -e``; the ``sys.path`` additions of
    an environment whose only attnhost is that install."""
    holder = tmp_path / "work"
    checkout = holder / "attnhost"
    checkout.mkdir(parents=True)
    for name in ("core", "plugins"):
        shutil.copytree(ROOT / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, checkout / name)
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip uninstalls the running environment's own attnhost before installing this one
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "-I"]
    install = subprocess.run(
        [*pip, "--prefix", str(prefix), "-e", str(checkout)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    site = tmp_path / "site"  # this environment less its own attnhost
    site.mkdir()
    site_packages = Path(importlib_metadata.__file__).parents[1]
    for item in site_packages.iterdir():
        if not item.name.startswith("attnhost"):
            os.symlink(item, site / item.name)
    editable = next(prefix.glob("lib/python*/site-packages"))
    return holder, [str(site), str(editable)]


def test_the_quoted_errors_are_what_the_checkouts_parent_directory_gives(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the conformance suite imports it
    holder, sites = _editable_checkout(tmp_path)
    prelude = f"import site, sys\nfor path in {sites!r}:\n    site.addsitedir(path)\n"
    env = subprocess_env((), {"PYTHONPATH": ""})

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-S", "-c", prelude + code], capture_output=True, text=True, cwd=holder, env=env
        )

    cli = run("import runpy\nsys.argv = ['attnhost', 'list']\nrunpy.run_module('attnhost', run_name='__main__')")
    kit = run("import pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--attnhost-backend', 'x']))")
    cli_error = "ImportError: cannot import name '__version__' from 'attnhost' (unknown location)"
    kit_error = "AttributeError: module 'attnhost' has no attribute '__version__'"
    assert cli.returncode != 0 and cli_error in cli.stderr, cli.stderr[-2000:]
    assert kit.returncode != 0 and kit_error in kit.stdout, kit.stdout[-2000:]
    guide = flat(plugin_guide())
    assert f"`python -m attnhost` then fails with `{cli_error}`" in guide
    assert f"every test of `python -m pytest --attnhost-backend acme` with `{kit_error}`" in guide
    # Elsewhere the same install works: the advice is to move, not to reinstall.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fine = subprocess.run(
        [sys.executable, "-S", "-c", prelude + "import attnhost\nprint(attnhost.__version__)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
    )
    assert fine.returncode == 0 and fine.stdout.strip(), fine.stderr[-2000:]
