"""CLI cold start: ``attnhost list --json`` against a bare ``importlib.metadata`` entry-point scan.

The floor is the least any entry-point based tool could do:
``python -c "import importlib.metadata as m; m.entry_points(group=...)"``,
which only *finds* entry points. ``attnhost list --json`` also imports and
registers every plugin through pluggy, builds the registry, checks each
backend's availability and prints JSON; the target is to be no slower.

Both run as fresh interpreters with this Python, from an empty directory that
is older than the cache's racy window, with a private ``XDG_CACHE_HOME``.
``PYTHONDONTWRITEBYTECODE`` is removed from their environment and every
command runs once before timing, so modules load from warm bytecode as on an
installed system (otherwise every run would compile every module from source).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from _common import GROUP, Row, interleaved, settle_environment

FLOOR_CODE = f"import importlib.metadata as m; m.entry_points(group={GROUP!r})"


def _child_env(xdg: Path, pythonpath: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["XDG_CACHE_HOME"] = str(xdg)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    return env


def _attnhost_command() -> tuple[list[str], str]:
    """The console script run by this interpreter (as its shebang would), else ``python -m attnhost``."""
    script = Path(sysconfig.get_path("scripts")) / "attnhost"
    if script.is_file():
        return [sys.executable, str(script), "list", "--json"], "attnhost list --json"
    return [sys.executable, "-m", "attnhost", "list", "--json"], "python -m attnhost list --json"


def _runner(argv: list[str], env: dict[str, str], cwd: Path) -> Callable[[], None]:
    def run() -> None:
        subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)

    return run


def _check(argv: list[str], env: dict[str, str], cwd: Path, expect_plugins: int) -> list[str]:
    """Sanity checks and notes: the output lists the plugins, and attnhost's scan cache is engaged."""
    notes = []
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout
    loaded = [p for p in json.loads(out)["plugins"] if p["status"] == "loaded" and not p["builtin"]]
    if len(loaded) != expect_plugins:
        raise RuntimeError(f"attnhost list loaded {len(loaded)} third-party plugins, expected {expect_plugins}")
    # The same sys.path as the measured command (a script's own directory first), so the same cache file.
    first = os.path.dirname(argv[1]) if argv[1] != "-m" else str(cwd)
    probe = (
        f"import sys; sys.path[0] = {first!r}; from attnhost import entry_points as e; "
        f"e.scan({GROUP!r}); print(e.scan_stats()['cache_hits'])"
    )
    hits = subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True)
    if hits.stdout.strip() != "1":
        notes.append(
            "attnhost's entry-point cache did not engage (something on sys.path changed < 3 s ago): "
            "the attnhost figure is an uncached start"
        )
    return notes


def run(rounds: int, workdir: Path, synthetic: Path | None, n_dists: int, n_plugins: int) -> list[Row]:
    rows: list[Row] = []
    attnhost_argv, label = _attnhost_command()
    cwd = workdir / "cwd"
    environments: list[tuple[str, Path | None, int]] = [("current environment", None, 0)]
    if synthetic is not None:
        environments.append((f"{n_dists} dists / {n_plugins} plugins", synthetic, n_plugins))
    for case, pythonpath, expect in environments:
        xdg = workdir / f"xdg-cli-{len(rows)}"
        env = _child_env(xdg, pythonpath)
        floor = [sys.executable, "-c", FLOOR_CODE]
        module_argv = [sys.executable, "-m", "attnhost", "list", "--json"]
        for argv in (floor, attnhost_argv, module_argv, floor, attnhost_argv, module_argv):
            subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        # The first runs wrote bytecode (plugins' __pycache__ inside the synthetic site-packages): wait
        # until that is older than the cache's racy window, then let attnhost write its cache.
        settle_environment()
        for argv in (attnhost_argv, module_argv):
            subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        notes = _check(attnhost_argv, env, cwd, expect)
        uncached_env = dict(env, ATTNHOST_NO_CACHE="1")
        stats = interleaved(
            {
                "floor": _runner(floor, env, cwd),
                "attnhost": _runner(attnhost_argv, env, cwd),
                "module": _runner(module_argv, env, cwd),
                "uncached": _runner(attnhost_argv, uncached_env, cwd),
            },
            rounds,
            warmup=0,
        )
        floor_label = "python -c 'importlib.metadata.entry_points(group=...)'"
        for key, name, target in (
            ("attnhost", label, True),
            ("module", "python -m attnhost list --json", False),
            ("uncached", f"{label} (ATTNHOST_NO_CACHE=1)", False),
        ):
            rows.append(
                Row(
                    section="CLI cold start",
                    case=case,
                    candidate=name,
                    value=stats[key].median * 1e3,
                    baseline=floor_label,
                    baseline_value=stats["floor"].median * 1e3,
                    unit="ms",
                    spread=stats[key].spread,
                    baseline_spread=stats["floor"].spread,
                    n=stats[key].n,
                    target="ratio <= 1.0" if target else None,
                    max_ratio=1.0 if target else None,
                    notes=notes if target else [],
                )
            )
    return rows
