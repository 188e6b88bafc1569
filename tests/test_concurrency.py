"""Plugins load once per process — under threads, in fork children and in spawned workers.

Each scenario runs in a fresh interpreter against a real installed plugin
whose module appends ``<pid>`` to a marker file when imported, so the test
counts imports per process exactly: a fork child of a loaded parent must not
import again (and must not skip: it sees the parent's full registry), a child
forked before loading imports once itself, and a spawned worker imports once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import make_plugin, subprocess_env

PLUGIN = """
import os
import attnhost

with open(os.environ["MARKER"], "a") as f:
    f.write(f"{os.getpid()}\\n")

@attnhost.hookimpl
def attnhost_attention_backends():
    # torch_native's kernels under a second name: a real, draft-capable backend runners can build.
    factory = "attnhost_builtin.torch_native:TorchNativeAttnBackend"
    return [attnhost.BackendSpec(name="counted", factory=factory, aliases=("counted_alias",))]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["counted"]
"""

THREADS = """
import json, sys, threading
import attnhost
from attnhost import ModelRunner, ServerArgs
from attnhost.host import default_host
from attnhost.resolution import resolve

N = 12
barrier = threading.Barrier(N)
results, errors = [None] * N, []

def work(i):
    try:
        barrier.wait()
        registry = attnhost.get_registry()
        args = ServerArgs(attention_backend="torch_native", speculative_draft_attention_backend="counted_alias")
        resolution = resolve(args, "cpu").to_json()
        target = ModelRunner(args, platform="cpu", num_layers=1, max_requests=2, max_context_len=16)
        draft = ModelRunner(args, is_draft=True, platform="cpu", num_layers=1, max_requests=2, max_context_len=16)
        results[i] = {
            "registry": id(registry),
            "pm": id(default_host().plugin_manager()),
            "names": list(registry.names()),
            "draft_names": list(registry.names("draft")),
            "resolution": resolution,
            "target": [target.prefill_attention_backend_str, target.decode_attention_backend_str],
            "draft": [draft.prefill_attention_backend_str, draft.decode_attention_backend_str],
            "distinct_backends": target.attn_backend is not draft.attn_backend,
        }
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print(json.dumps({"results": results, "errors": errors}))
"""

PROCESSES = """
import json, multiprocessing as mp, os, sys, threading
import attnhost
from attnhost.host import default_host

def report(path):
    registry = attnhost.get_registry()
    again = attnhost.get_registry()
    status = {p.name: p.status.value for p in default_host().plugins()}
    data = {"pid": os.getpid(), "names": list(registry.names()), "same": registry is again, "status": status}
    with open(path, "w") as f:
        json.dump(data, f)

def run_child(method):
    path = sys.argv[2]
    proc = mp.get_context(method).Process(target=report, args=(path,))
    proc.start()
    proc.join(60)
    if proc.exitcode is None:
        proc.kill()
    return proc.exitcode, json.load(open(path)) if proc.exitcode == 0 else None

if __name__ == "__main__":
    scenario = sys.argv[1]
    out = {"parent": os.getpid()}
    if scenario == "fork-before-load":
        out["child"] = run_child("fork")
    elif scenario == "fork-while-locked":
        # Another thread holds the host's lock when we fork: the child must not inherit it held.
        held, release = threading.Event(), threading.Event()
        def hold():
            with default_host()._lock:
                held.set()
                release.wait(30)
        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(30)
        out["child"] = run_child("fork")
        release.set()
        holder.join()
    attnhost.get_registry()
    if scenario == "fork-after-load":
        out["child"] = run_child("fork")
    elif scenario == "spawn-after-load":
        out["child"] = run_child("spawn")
    out["names"] = list(attnhost.get_registry().names())
    print(json.dumps(out))
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    make_plugin(site, "counted-attn", "1.0", "counted", "counted_plugin", PLUGIN)
    return site


def _run(site: Path, code: str, *argv: str) -> tuple[dict[str, Any], Counter[int]]:
    marker = site.parent / "marker"
    script = site.parent / "scenario.py"
    script.write_text(code)
    env = subprocess_env([site], {"MARKER": str(marker), "XDG_CACHE_HOME": str(site.parent)})
    result = subprocess.run(
        [sys.executable, str(script), *argv, str(site.parent / "child.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    imports = Counter(int(pid) for pid in marker.read_text().split()) if marker.exists() else Counter()
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data, imports


@pytest.mark.torch  # its workers run a model runner
def test_threads_load_once_and_agree(site: Path) -> None:
    data, imports = _run(site, THREADS)
    assert data["errors"] == []
    results = data["results"]
    assert len(results) == 12 and all(results)
    assert all(r == results[0] for r in results), "every thread must see the same registry and resolution"
    first = results[0]
    assert "counted" in first["names"] and "counted" in first["draft_names"]
    assert first["resolution"]["draft"] == "counted" and first["resolution"]["prefill"] == "torch_native"
    assert first["target"] == ["torch_native", "torch_native"] and first["draft"] == ["counted", "counted"]
    assert first["distinct_backends"]
    assert list(imports.values()) == [1], "the plugin module is imported exactly once"


def test_fork_child_of_a_loaded_parent_reuses_its_plugins(site: Path) -> None:
    data, imports = _run(site, PROCESSES, "fork-after-load")
    exitcode, child = data["child"]
    assert exitcode == 0 and child["same"]
    assert child["names"] == data["names"] and "counted" in child["names"], "the child must not skip plugins"
    assert child["status"]["counted"] == "loaded"
    assert imports == Counter({data["parent"]: 1}), "the fork child must not import the plugin again"


@pytest.mark.parametrize("scenario", ["fork-before-load", "fork-while-locked"])
def test_fork_child_before_loading_loads_once_itself(site: Path, scenario: str) -> None:
    data, imports = _run(site, PROCESSES, scenario)
    exitcode, child = data["child"]
    assert exitcode == 0 and child["same"] and child["names"] == data["names"]
    assert "counted" in child["names"]
    assert imports == Counter({data["parent"]: 1, child["pid"]: 1})


def test_spawned_worker_loads_once(site: Path) -> None:
    data, imports = _run(site, PROCESSES, "spawn-after-load")
    exitcode, child = data["child"]
    assert exitcode == 0 and child["same"] and child["names"] == data["names"]
    assert child["pid"] != data["parent"]
    assert imports == Counter({data["parent"]: 1, child["pid"]: 1})
