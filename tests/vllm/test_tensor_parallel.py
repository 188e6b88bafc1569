"""attnhost's rank-agreement check on vLLM's own tensor-parallel group (issue 25, item 3).

What runs: two ranks per case, each its own interpreter and environment as vLLM's launcher would start
them, each loading vLLM's general plugins (attnhost registers with vLLM), setting up vLLM's distributed
state with vLLM's own ``init_distributed_environment`` (gloo) and ``initialize_model_parallel``, and
running :func:`attnhost.distributed.check_ranks_agree` on ``get_tp_group().cpu_group``, vLLM's CPU-side
group for its tensor-parallel ranks.

What cannot run here: a vLLM engine with ``tensor_parallel_size=2``. The PyPI wheel's CPU path needs
``vllm._C`` built for CPUs, which the wheel does not contain (its kernels are CUDA builds), so no vLLM
worker can load or run a model on this machine, one rank or two. vLLM 0.33 also has no hook registry
through which a plugin could run code where its workers finish their set-up, so attnhost does not yet
call the check inside vLLM by itself; a vLLM deployment calls it (for example from a worker extension)
as this test does.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RANK_SCRIPT = """
import json, sys
from datetime import timedelta

rank, port = int(sys.argv[1]), sys.argv[2]
from vllm.plugins import load_general_plugins

load_general_plugins()
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import get_tp_group, init_distributed_environment, initialize_model_parallel

with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(
        world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
        backend="gloo", timeout=timedelta(seconds=60),
    )
    initialize_model_parallel(tensor_model_parallel_size=2)
    tp = get_tp_group()
    from attnhost.distributed import RankMismatchError, check_ranks_agree

    report = {"tp_world": tp.world_size, "tp_rank": tp.rank_in_group}
    try:
        fingerprints = check_ranks_agree(group=tp.cpu_group, platform="cpu")
        report["agreed"] = [fp.rank for fp in fingerprints]
    except RankMismatchError as exc:
        report["error"] = str(exc)
print("REPORT " + json.dumps(report), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Two cases, both pairs started at once: ranks with one environment, and rank 1 with another allow-list."""
    import os

    script = Path(tmp_path_factory.mktemp("vllm-ranks")) / "rank.py"
    script.write_text(RANK_SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    cases = {"same": [{}, {}], "differ": [{}, {"ATTNHOST_PLUGINS": "tiny"}]}
    procs: dict[str, list[subprocess.Popen[str]]] = {}
    for case, envs in cases.items():
        port = str(_free_port())
        procs[case] = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), port],
                env={**base, **extra},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, extra in enumerate(envs)
        ]
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for case, ranks in procs.items():
            out[case] = []
            for rank, proc in enumerate(ranks):
                stdout, stderr = proc.communicate(timeout=240)
                lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
                assert proc.returncode == 0 and lines, f"{case} rank {rank} failed:\n{stderr[-4000:]}"
                out[case].append(json.loads(lines[-1].removeprefix("REPORT ")))
    finally:
        for ranks in procs.values():
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
    return out


def test_ranks_with_one_environment_agree_on_vllms_tp_group(reports: dict[str, list[dict[str, Any]]]) -> None:
    for rank, report in enumerate(reports["same"]):
        assert (report["tp_world"], report["tp_rank"]) == (2, rank)
        assert report.get("agreed") == [0, 1], report


def test_a_rank_with_another_allow_list_fails_on_every_rank_alike(reports: dict[str, list[dict[str, Any]]]) -> None:
    errors = [report.get("error") for report in reports["differ"]]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "rank(s) 1 vs rank 0" in errors[0]
    assert "plugin 'batched' (distribution attnhost-batched " in errors[0]
    assert "is not-allowed on rank 1 but loaded on rank 0; backends missing: batched_matmul" in errors[0]
