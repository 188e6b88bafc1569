"""attnhost inside a real ``sglang.Engine`` with tensor parallelism, and every rank agreeing.

Two kinds of run, each in its own interpreter and process group:

* One engine driver (the test kit's ``attnhost_sglang_cpu.run_engine``) builds, in turn, a ``tp_size=2`` engine for each
  attnhost backend and a ``tp_size=1`` engine for the built-in one: all generate HF transformers' greedy
  ids. SGLang shards the model over two gloo ranks; each rank's adapter attends over its own KV heads.
  (``tp_size=1`` equals HF for every backend in test_engine.py; one ``tp_size=1`` start here keeps the
  direct comparison without paying an engine start per backend twice.)
* Two drivers emulate a two-node deployment (``nnodes=2``, one rank per node, SGLang's own multi-node
  launch over ``dist_init_addr`` on 127.0.0.1): node 0's environment has the plugin distribution
  ``acme-attn`` installed and serves with ``attention_backend="acme"``, node 1's image lacks it and
  serves with ``attnhost_torch_native``, as an operator half-way through a rollout would. The agreement
  check, installed through SGLang's HookRegistry, must stop the engine on both ranks with the one
  error naming what differs, within a bound, and leave no process behind (any leftover is killed by
  process group and fails the test).

SGLang wants ``SGLANG_CPU_OMP_THREADS_BIND`` (one entry per rank) when the ranks outnumber NUMA nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from attnhost_sglang_cpu import driver_command, sglang_env
from attnhost_sglang_cpu.e2e import ADAPTER, TinyModel, check_probe, read_probe
from attnhost_sglang_cpu.procs import Finished, describe, free_port, kill_group, run_in_group, wait_group_empty
from conftest import NEW_TOKENS
from distgen import make_dist

BACKENDS = ("attnhost_torch_native", "tiny", "batched_matmul")
RUNS = [("attnhost_torch_native", 1), *((backend, 2) for backend in BACKENDS)]
RANK_CPUS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
MISMATCH_TIMEOUT = 300  # seconds for both nodes to start, disagree and exit

ACME = '''"""A vendor plugin only node 0 has installed: the tiny example's kernel under another name."""
from attnhost_tiny import TinyAttnBackend


class AcmeBackend(TinyAttnBackend):
    pass
'''


@dataclass(frozen=True)
class TpRuns:
    driver: Finished
    results: dict[str, dict[str, Any]]
    probes: dict[str, Path]


def run_id(backend: str, tp: int) -> str:
    return f"{backend}@tp{tp}"


@pytest.fixture(scope="module")
def tp_runs(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> TpRuns:
    """Each backend's ``tp_size=2`` engine and the built-in's ``tp_size=1`` one (the ranks' CPU binding set), one
    after another in one driver process: one of the slow set-ups, engine configurations no other test starts."""
    probes_dir = tmp_path_factory.mktemp("tp-probes")
    runs = [
        {
            "backend": backend,
            "name": run_id(backend, tp),
            "probe": str(probes_dir / f"{run_id(backend, tp)}.jsonl"),
            "engine_args": {"tp_size": tp},
        }
        for backend, tp in RUNS
    ]
    job = {"model": str(tiny_model.path), "prompts": tiny_model.prompts, "new_tokens": NEW_TOKENS, "runs": runs}
    done = run_in_group(
        driver_command("run_engine", json.dumps(job)),
        sglang_env(RANK_CPUS),
        timeout=900,
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["name"]] = record
    return TpRuns(done, results, {run["name"]: Path(run["probe"]) for run in runs})


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_generates_hf_greedy_ids_as_tp1_does(backend: str, tp_runs: TpRuns, tiny_model: TinyModel) -> None:
    by_tp = {}
    for tp in sorted({tp for name, tp in RUNS if name == backend}):
        result = tp_runs.results.get(run_id(backend, tp))
        assert result is not None, f"the driver died before {run_id(backend, tp)}:\n{tp_runs.driver.stderr[-4000:]}"
        assert "error" not in result, f"sglang.Engine(tp_size={tp}) with {backend!r} failed:\n{result['error']}"
        assert result["children_left"] == [], result["children_left"]
        by_tp[tp] = result["output_ids"]
    assert by_tp[2] == tiny_model.hf_ids
    assert by_tp.get(1, by_tp[2]) == by_tp[2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_tp2_rank_built_and_ran_the_adapter(backend: str, tp_runs: TpRuns) -> None:
    result = tp_runs.results[run_id(backend, 2)]
    records = read_probe(tp_runs.probes[run_id(backend, 2)])
    check_probe(records, backend, ADAPTER, not_pid=result["driver_pid"])
    ranks = {r["pid"] for r in records if r["event"] == "runner"}
    assert len(ranks) == 2, f"expected one model runner in each of two scheduler processes, saw {records}"


def test_tp_driver_left_nothing_behind(tp_runs: TpRuns) -> None:
    assert tp_runs.driver.returncode == 0, tp_runs.driver.stderr[-4000:]
    assert tp_runs.driver.leftover == "none"


# -- ranks that disagree -------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    rank: int
    returncode: int | None
    stderr: str
    seconds: float
    leftover: str


@pytest.fixture(scope="module")
def disagreeing_nodes(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> list[Node]:
    """Start both nodes of a two-node, tp_size=2 engine whose ranks see different plugins; wait for both (a
    configuration no other test starts: each node a fresh driver, as the failure must end both)."""
    acme_site = tmp_path_factory.mktemp("node0-only-site")
    make_dist(
        acme_site,
        "acme-attn",
        "1.2",
        {"sglang.draft_attention_backends": {"acme": "acme_attn:AcmeBackend"}},
        modules={"acme_attn": ACME},
    )
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    procs = []
    for rank, backend in enumerate(("acme", "attnhost_torch_native")):
        engine_args = {"tp_size": 2, "nnodes": 2, "node_rank": rank, "dist_init_addr": address, "port": free_port()}
        job = {
            "model": str(tiny_model.path),
            "prompts": tiny_model.prompts,
            "new_tokens": NEW_TOKENS,
            "runs": [{"backend": backend, "probe": os.devnull, "engine_args": engine_args}],
        }
        # A follower node's Engine returns once its schedulers are up instead of blocking on them.
        env = sglang_env({**RANK_CPUS, "SGLANG_BLOCK_NONZERO_RANK_CHILDREN": "0"})
        if rank == 0:
            env["PYTHONPATH"] = os.pathsep.join((str(acme_site), env["PYTHONPATH"]))
        cmd = driver_command("run_engine", json.dumps(job))
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
        )
    nodes = []
    try:
        for rank, proc in enumerate(procs):
            remaining = max(1.0, MISMATCH_TIMEOUT - (time.monotonic() - started))
            try:
                _, stderr = proc.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid)
                _, stderr = proc.communicate()
                stderr += f"\n[test] node {rank} ran past {MISMATCH_TIMEOUT} s; its process group was killed"
            seconds = time.monotonic() - started
            left = wait_group_empty(proc.pid, timeout=30)
            nodes.append(Node(rank, proc.returncode, stderr, seconds, describe(left)))
    finally:
        for proc in procs:  # whatever is still there is killed by its process group, never left running
            kill_group(proc.pid)
    return nodes


def _mismatch_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("attnhost.errors.RankMismatchError: ")]


def test_ranks_with_different_plugins_stop_the_engine_on_both_ranks(disagreeing_nodes: list[Node]) -> None:
    messages = []
    for node in disagreeing_nodes:
        lines = _mismatch_lines(node.stderr)
        assert lines, f"node {node.rank} did not stop with the agreement error:\n{node.stderr[-5000:]}"
        assert f" TP{node.rank}] Scheduler hit an exception" in node.stderr, node.stderr[-3000:]
        messages += lines
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
    message = messages[0]
    assert "rank(s) 1 vs rank 0" in message
    assert "plugin 'acme' (distribution acme-attn 1.2) missing (rank 0: loaded)" in message
    assert "backends missing: acme" in message
    for role in ("prefill", "decode"):
        assert f"target runner 0 resolved {role} 'attnhost_torch_native' on rank 1, 'acme' on rank 0" in message
    assert "install the same plugin packages on every rank" in message


def test_disagreeing_ranks_stop_within_a_bound_and_leave_nothing_behind(disagreeing_nodes: list[Node]) -> None:
    for node in disagreeing_nodes:
        assert "ran past" not in node.stderr, node.stderr[-3000:]
        assert node.seconds < MISMATCH_TIMEOUT
        assert node.returncode != 0, f"node {node.rank}'s driver exited cleanly although its engine could not start"
        assert node.leftover == "none", f"node {node.rank} left processes behind: {node.leftover}"
