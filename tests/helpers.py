"""Run attnhost in a subprocess against real distributions on extra ``sys.path`` entries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from distgen import make_dist

GROUP = "sglang.draft_attention_backends"
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc(page: str) -> str:
    """One page of the docs site (``docs/PAGE``), as a reader gets it."""
    return (DOCS / page).read_text(encoding="utf-8")


def reader_pages() -> dict[str, str]:
    """Everything a user reads: the README (the front page) and every page of the docs site, by path."""
    pages = {"README.md": README.read_text(encoding="utf-8")}
    pages.update({f"docs/{path.name}": path.read_text(encoding="utf-8") for path in sorted(DOCS.glob("*.md"))})
    return pages


def flat(text: str) -> str:
    """``text`` with every run of whitespace one space: prose checks must not pin where a line breaks."""
    return " ".join(text.split())


def plugin_guide() -> str:
    """The plugin guide: what a plugin author follows, so what the tests build plugins from."""
    return doc("plugin-guide.md")


def guide_block(guide: str, first_line: str) -> str:
    """The fenced block of the guide whose first line is ``first_line`` (a file-name comment)."""
    for match in re.finditer(r"```(?:python|toml)\n(.*?)```", guide, re.S):
        if match.group(1).startswith(first_line):
            return match.group(1)
    raise AssertionError(f"the plugin guide lost its block starting {first_line!r}")


def subprocess_env(path_entries: Iterable[Path | str] = (), env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment with ``path_entries`` first on PYTHONPATH and no attnhost settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    entries = [str(p) for p in path_entries]
    if base.get("PYTHONPATH"):
        entries.append(base["PYTHONPATH"])
    if entries:
        base["PYTHONPATH"] = os.pathsep.join(entries)
    base.update(env or {})
    return base


def run_cli(
    *args: str, path_entries: Iterable[Path | str] = (), env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m attnhost ARGS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "attnhost", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(path_entries, env),
        timeout=120,
    )


def run_python(
    code: str, *, path_entries: Iterable[Path | str] = (), env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(path_entries, env),
        timeout=120,
    )


def list_json(path_entries: Iterable[Path | str] = (), env: Mapping[str, str] | None = None) -> dict[str, Any]:
    result = run_cli("list", "--json", path_entries=path_entries, env=env)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def make_plugin(
    root: Path, dist: str, version: str, entry_name: str, module: str, source: str, attr: str | None = None
) -> Path:
    """One plugin distribution: a module with ``source`` and an entry point ``entry_name = module[:attr]``."""
    value = f"{module}:{attr}" if attr else module
    return make_dist(root, dist, version, {GROUP: {entry_name: value}}, modules={module: source})


def kit_run_problems(stdout: str, skips_allowed: Iterable[str]) -> list[str]:
    """What is wrong with a pytest ``-q -rs`` run of the conformance kit: a failure or error, no test passed, or a
    skip whose reason is not one of ``skips_allowed`` (what the backends do not declare). Counts are not pinned:
    the kit grows with the contract, and a count says less than the reasons."""
    summary = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    problems = [f"{counts[w]} {w}" for w in ("failed", "error", "errors") if counts.get(w)]
    if not counts.get("passed"):
        problems.append(f"no test passed ({summary!r})")
    allowed = tuple(skips_allowed)
    for line in stdout.splitlines():
        if line.startswith("SKIPPED") and not any(reason in line for reason in allowed):
            problems.append(f"unexpected skip: {line}")
    return problems


def pytest_command(*args: str) -> list[str]:
    """``python -m pytest -p no:cacheprovider -q ARGS`` with this interpreter: pytest in a fresh process, as a plugin
    author runs it from their own directory (no cache directory left behind there)."""
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]


def kit_outcomes(site: Path, cwd: Path, names: Iterable[str], selection: str) -> dict[str, str]:
    """One fresh-interpreter run of the conformance kit's tests matching ``-k selection`` against the backends
    ``names`` installed in ``site``, as an author runs it: ``{"test_x[params]": failure text, or "" if passed}``."""
    backends = ",".join(names)
    proc = subprocess.run(
        pytest_command("-rA", "--attnhost-backend", backends, "-k", selection),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(cwd / "xdg"), "COLUMNS": "2000"}),
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    outcome = {}
    for line in proc.stdout.splitlines():
        found = re.match(r"(PASSED|FAILED) \S*::(test_\w+\[[\w-]+\])(?: - (.*))?$", line)
        if found:
            outcome[found.group(2)] = (found.group(3) or "?") if found.group(1) == "FAILED" else ""
    return outcome
