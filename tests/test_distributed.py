"""Ranks agree: three gloo processes on CPU, one given a different allow-list, must all raise — never hang.

The ranks are plain subprocesses (not forks of pytest), each with its own
environment, exactly as a launcher starts a tensor-parallel server.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import make_plugin, subprocess_env

pytest.importorskip("torch.distributed")

# A platform plugin: it makes itself the default and the draft fallback, so a rank
# that does not load it resolves different backends from the same (empty) args.
ACME = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return [attnhost.BackendSpec(name="acme", factory="acme_kernels:Backend")]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["acme"]

@attnhost.hookimpl
def attnhost_default_attention_backend(platform):
    return "acme"

@attnhost.hookimpl
def attnhost_draft_fallback(platform):
    return "acme"
"""

OTHER = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return [attnhost.BackendSpec(name="other", factory="other_kernels:Backend")]
"""

RANK_SCRIPT = """
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from attnhost.distributed import RankCheckError, RankMismatchError, check_ranks_agree

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=20)
)
report = {}

def attempt(label, **kwargs):
    started = time.monotonic()
    try:
        fps = check_ranks_agree(**kwargs)
        report[label] = {"ok": [fp.resolved for fp in fps]}
    except RankCheckError as exc:
        report[label] = {"error": type(exc).__name__, "message": str(exc)}
    report[label]["seconds"] = time.monotonic() - started

# Ranks 0 and 1 share an environment: their subgroup agrees.
pair = dist.new_group([0, 1])
if rank in (0, 1):
    attempt("pair", group=pair, platform="cpu")
# The whole world does not: every rank must raise the same error.
attempt("world", platform="cpu")
# A rank that never joins: rank 0 must give up within the subgroup's timeout, not hang.
short = dist.new_group([0, 1], timeout=timedelta(seconds=2))
if rank == 0:
    attempt("absent", group=short, platform="cpu")
print(json.dumps(report), flush=True)
if rank == 1:
    time.sleep(4)  # outlive rank 0's wait, so the timeout (not a closed socket) ends it
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def rank_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ranks")
    site = root / "site"
    make_plugin(site, "acme-attn", "1.0", "acme", "acme_plugin", ACME)
    make_plugin(site, "other-attn", "2.0", "other", "other_plugin", OTHER)
    script = root / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = str(_free_port())
    world = 3
    procs = []
    for rank in range(world):
        env = {"XDG_CACHE_HOME": str(root / f"cache{rank}")}
        if rank == 2:
            env["ATTNHOST_PLUGINS"] = "other"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(world), port],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=subprocess_env([site], env),
            )
        )
    reports = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"rank {rank}: {err}"
            assert "Traceback" not in err, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return reports


def test_ranks_that_agree_pass(rank_reports: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert rank_reports[rank]["pair"]["ok"] == [["acme", "acme", "acme"]] * 2


def test_a_rank_with_another_allow_list_makes_every_rank_raise_the_same_error(
    rank_reports: list[dict[str, Any]],
) -> None:
    worlds = [report["world"] for report in rank_reports]
    assert all(w.get("error") == "RankMismatchError" for w in worlds), worlds
    messages = {w["message"] for w in worlds}
    assert len(messages) == 1, "every rank reports the same difference"
    message = messages.pop()
    assert "rank(s) 2 vs rank 0" in message and "rank 2 differs from rank 0" in message
    assert "rank 1 differs" not in message
    assert "plugin 'acme' (distribution acme-attn 1.0) is not-allowed on rank 2 but loaded on rank 0" in message
    assert "backends missing: acme" in message
    assert "prefill 'torch_native' vs 'acme'" in message and "draft 'flashinfer' vs 'acme'" in message
    assert "\n" not in message


def test_a_rank_that_never_joins_is_a_bounded_error_not_a_hang(rank_reports: list[dict[str, Any]]) -> None:
    absent = rank_reports[0]["absent"]
    assert absent["error"] == "RankCheckError", absent
    assert "every rank of the group must call check_ranks_agree" in absent["message"]
    # Bounded by the group's 2 s timeout; a hang would instead trip communicate(timeout=60) above.


def test_fingerprint_differences_are_named() -> None:
    from attnhost.distributed import RankFingerprint, compare_fingerprints

    builtin = ("builtin", "attnhost", "0.1.0", "loaded")
    base = RankFingerprint(0, "cpu", (builtin,), (("torch_native", "builtin", False),), ("a", "a", "b"))
    same = RankFingerprint(1, "cpu", base.plugins, base.backends, base.resolved)
    assert compare_fingerprints([same, base]) is None
    newer = RankFingerprint(3, "cuda", (("builtin", "attnhost", "0.2.0", "loaded"),), base.backends, base.resolved)
    broken = RankFingerprint(2, "cpu", base.plugins, (), None, "UnknownBackendError: unknown attention backend 'x'")
    message = compare_fingerprints([base, same, newer, broken])
    assert message is not None
    assert "rank(s) 2, 3 vs rank 0" in message
    assert "rank 2 differs from rank 0: it could not resolve (UnknownBackendError" in message
    assert "platform 'cuda' vs 'cpu'" in message
    assert "plugin 'builtin' is attnhost 0.2.0 on rank 3 but attnhost 0.1.0 on rank 0" in message


def test_engine_runner_differences_are_named_per_runner_and_role() -> None:
    """An engine bridge compares what its model runners resolved, not attnhost's own resolution."""
    from attnhost.distributed import RankFingerprint, compare_fingerprints

    builtin = ("builtin", "attnhost", "0.1.0", "loaded")
    runners = (("target runner 0", "acme", "acme", None), ("draft runner 1", "acme", "acme", "acme"))
    base = RankFingerprint(0, "cpu", (builtin,), (), None, runners=runners)
    assert compare_fingerprints([base, RankFingerprint(1, "cpu", (builtin,), (), None, runners=runners)]) is None
    other = (("target runner 0", "acme", "triton", None), ("draft runner 1", "acme", "acme", "triton"))
    message = compare_fingerprints([base, RankFingerprint(1, "cpu", (builtin,), (), None, runners=other)])
    assert message is not None
    assert "target runner 0 resolved decode 'triton' on rank 1, 'acme' on rank 0" in message
    assert "draft runner 1 resolved draft 'triton' on rank 1, 'acme' on rank 0" in message
    assert "prefill" not in message
    fewer = compare_fingerprints([base, RankFingerprint(1, "cpu", (builtin,), (), None, runners=runners[:1])])
    assert fewer is not None and "1 model runner(s) vs 2" in fewer


def test_check_needs_an_initialised_group() -> None:
    from attnhost.distributed import RankCheckError, check_ranks_agree

    with pytest.raises(RankCheckError, match="initialised"):
        check_ranks_agree()


def test_importing_the_module_does_not_import_torch(tmp_path: Path) -> None:
    code = "import sys, attnhost.distributed; assert 'torch' not in sys.modules; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
