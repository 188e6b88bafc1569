"""attnhost's rank-agreement check where vLLM's workers start, on vLLM's real worker path.

What runs: two rank processes per case, each its own interpreter and environment, as vLLM's multiprocess
executor starts its workers. Each goes through vLLM's own worker start-up as far as this CPU allows:
``WorkerWrapperBase.init_worker`` (which loads vLLM's general plugins, so attnhost registers and installs
its check), ``CPUWorker.init_device`` (vLLM's gloo process groups, ``init_worker_distributed_environment``,
and the CPU model runner), and ``load_model`` on a two-layer Llama with dummy weights, which builds the real
model, whose attention layers choose their backends with vLLM's ``get_attn_backend`` (``CPU_ATTN`` here,
vLLM's own), and then stops where the CPU wheel lacks what loading needs (see below). Then each rank runs
the hooked method, ``get_supported_kv_cache_layouts``, through vLLM's ``run_method``, exactly as the
engine core's ``collective_rpc`` runs it on every worker before profiling; attnhost's wrapper does the one
collective on ``get_tp_group().cpu_group``. Ranks with one environment agree silently and get vLLM's
answer; a rank with an extra plugin distribution on its ``PYTHONPATH`` (and an operator's
``ATTNHOST_VLLM_OVERRIDE`` that lets it take over ``CPU_ATTN`` on that rank only) stops both ranks with the
one ``RankMismatchError``, within a bound, and no process of either rank is left (process groups killed
by PID). In-process tests cover the wrapper itself (installed once, vLLM's signature, installed on first
import when ``register()`` ran before vLLM's worker module was imported) and how layers are reported.

What cannot run here: a vLLM engine with ``tensor_parallel_size=2`` (or 1). PyPI's vLLM 0.33 wheel has no
CPU build of ``vllm._C``: ``CPUWorker.__init__`` needs ``torch.ops._C.init_cpu_memory_env`` (so the ranks
construct its base class, ``gpu_worker.Worker``, and run ``CPUWorker.init_device`` on it), and
``load_model`` stops after building the model, at ``compressed_tensors`` (not in this environment's pinned
set) or, with it, at ``torch.ops._C.convert_weight_packed``. So no profiling run, KV cache or forward runs
here, and the engine core's own ``collective_rpc`` call is replaced by the same ``run_method`` it uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from distgen import make_dist

from attnhost.engines.vllm import agreement

TIMEOUT = 240  # seconds for both ranks of a case to start, check and exit (they start in about 30 s alone)

RANK_SCRIPT = """
import json, sys, time

rank, port, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
from attnhost_vllm_cpu.triton_rule import answer_x86_triton_rule

answer_x86_triton_rule()  # vLLM >= 0.34 refuses an x86 VllmConfig without triton-cpu (not on PyPI)
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.serial_utils import run_method
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.worker_base import WorkerBase, WorkerWrapperBase

config = EngineArgs(
    model=model, skip_tokenizer_init=True, max_model_len=256, load_format="dummy", tensor_parallel_size=2,
    distributed_executor_backend="mp", distributed_timeout_seconds=120,
).create_engine_config()
report = {"worker_cls": config.parallel_config.worker_cls}
# CPUWorker.__init__ needs vllm._C, which this wheel lacks: its base class, and CPUWorker's init_device on it.
config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
wrapper = WorkerWrapperBase(rpc_rank=rank, global_rank=rank)  # as MultiprocExecutor's WorkerProc does
all_kwargs = [{}, {}]
all_kwargs[rank] = {
    "vllm_config": config, "local_rank": rank, "rank": rank,
    "distributed_init_method": f"tcp://127.0.0.1:{port}", "is_driver_worker": rank == 0,
}
try:
    wrapper.init_worker(all_kwargs)  # loads vLLM's general plugins: attnhost registers (and installs its check)
except ValueError as exc:  # vLLM >= 0.34: no worker on an x86 CPU without triton-cpu, which is not on PyPI
    if "requires Triton" not in str(exc):
        raise
    print("UNAVAILABLE " + json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
    sys.exit(0)
with set_current_vllm_config(config):
    CPUWorker.init_device(wrapper.worker)
try:
    wrapper.load_model()
except (ImportError, AttributeError) as exc:  # the model is built; loading weights needs what the wheel lacks
    report["load_model_stopped_at"] = repr(exc)
report["layers"] = sorted(config.compilation_config.static_forward_context)
from vllm.distributed.parallel_state import get_tp_group

report["tp"] = [get_tp_group().world_size, get_tp_group().rank_in_group]
started = time.perf_counter()
report["layouts"] = run_method(wrapper, "get_supported_kv_cache_layouts", (), {})  # as collective_rpc does
report["seconds"] = time.perf_counter() - started
report["checked"] = getattr(wrapper.worker, "_attnhost_ranks_agreed", False)
report["wrapped"] = getattr(WorkerBase.get_supported_kv_cache_layouts, "__attnhost_agreement__", False)
from attnhost.engines.vllm.agreement import layer_rows

report["rows"] = [list(row) for row in layer_rows(config)]
print("REPORT " + json.dumps(report), flush=True)
"""

#: A vendor plugin only rank 1 has installed: the tiny example's kernel, as a backend named ``cpu_attn``.
ACME = '''"""A vendor plugin only rank 1 has: the tiny example's kernel under the name of vLLM's CPU backend."""
from attnhost import BackendSpec, hookimpl
from attnhost_tiny import TinyAttnBackend


class AcmeBackend(TinyAttnBackend):
    pass


@hookimpl
def attnhost_attention_backends():
    return [BackendSpec(name="cpu_attn", factory="acme_attn:AcmeBackend", requires=("torch",),
                        description="acme's CPU kernel (test plugin)")]
'''


@dataclass(frozen=True)
class Rank:
    rank: int
    pid: int  # the rank's PID, also its process group's id
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float  # from the start of the case until this rank exited
    timed_out: bool
    leftover: list[str]  # processes of this rank's process group still alive after it exited (then killed)

    @property
    def unavailable(self) -> str | None:
        """Why vLLM built no worker here (vLLM >= 0.34 on an x86 CPU without triton-cpu), else ``None``."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("UNAVAILABLE ")]
        return str(json.loads(lines[-1].removeprefix("UNAVAILABLE "))) if lines else None

    @property
    def report(self) -> dict[str, Any]:
        lines = [line for line in self.stdout.splitlines() if line.startswith("REPORT ")]
        assert lines, f"rank {self.rank} reported nothing (exit {self.returncode}):\n{self.stderr[-4000:]}"
        report: dict[str, Any] = json.loads(lines[-1].removeprefix("REPORT "))
        return report

    def mismatch_lines(self) -> list[str]:
        """The error's lines in the traceback (torch prefixes an uncaught error's lines with ``[rankN]: ``)."""
        prefix, error = f"[rank{self.rank}]: ", "attnhost.errors.RankMismatchError: "
        lines = (line.removeprefix(prefix) for line in self.stderr.splitlines())
        return [line for line in lines if line.startswith(error)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _group(pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _kill_group(pgid: int) -> list[str]:
    """Kill what is left of a rank's process group (by its leader's PID); returns what was left."""
    deadline = time.monotonic() + 10
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a child (multiprocessing's resource tracker) exits on its own shortly after
    described = [f"{proc.pid} {' '.join(proc.cmdline()[:3])}" for proc in left]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return described


@pytest.fixture(scope="module")
def cases(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Rank]]:
    """Both cases' ranks start at once: one environment on both ranks; rank 1 with an extra plugin."""
    root = Path(tmp_path_factory.mktemp("vllm-ranks"))
    script = root / "rank.py"
    script.write_text(RANK_SCRIPT)
    acme_site = root / "rank1-only-site"
    make_dist(
        acme_site,
        "acme-attn",
        "1.2",
        {"sglang.draft_attention_backends": {"acme": "acme_attn"}},
        modules={"acme_attn": ACME},
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    rank1_extra = {
        "PYTHONPATH": os.pathsep.join(filter(None, (str(acme_site), base.get("PYTHONPATH")))),
        "ATTNHOST_VLLM_OVERRIDE": "cpu_attn",
    }
    envs = {"same": [base, base], "extra": [base, {**base, **rank1_extra}]}
    started = time.monotonic()
    procs: dict[str, list[subprocess.Popen[str]]] = {}
    try:
        for case, rank_envs in envs.items():
            port = str(_free_port())
            procs[case] = [
                subprocess.Popen(
                    [sys.executable, str(script), str(rank), port, tiny_model],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,  # its own process group, killed by its PID below
                )
                for rank, env in enumerate(rank_envs)
            ]
        out: dict[str, list[Rank]] = {}
        for case, ranks in procs.items():
            out[case] = []
            for rank, proc in enumerate(ranks):
                timed_out = False
                try:
                    stdout, stderr = proc.communicate(timeout=max(1.0, TIMEOUT - (time.monotonic() - started)))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    stdout, stderr = proc.communicate()
                seconds = time.monotonic() - started
                leftover = _kill_group(proc.pid)
                out[case].append(Rank(rank, proc.pid, proc.returncode, stdout, stderr, seconds, timed_out, leftover))
    finally:
        for ranks in procs.values():
            for proc in ranks:  # whatever is still there is killed by its process group, never left running
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return out


def _skip_without_a_worker(ranks: list[Rank]) -> None:
    """vLLM >= 0.34 builds no worker on an x86 CPU without triton-cpu (its model runner's kernels are Triton's), and
    triton-cpu is not on PyPI: there is no worker path to check on, which the ranks reported (exit 0)."""
    reasons = {rank.unavailable for rank in ranks} - {None}
    if reasons:
        assert all(rank.returncode == 0 and rank.unavailable for rank in ranks), [r.stderr[-2000:] for r in ranks]
        from importlib.metadata import version

        pytest.skip(f"vLLM {version('vllm')} starts no worker on this CPU: {' / '.join(sorted(map(str, reasons)))}")


def test_ranks_with_one_environment_agree_silently_on_vllms_worker_path(cases: dict[str, list[Rank]]) -> None:
    _skip_without_a_worker(cases["same"])
    for rank in cases["same"]:
        assert rank.returncode == 0 and not rank.timed_out, rank.stderr[-4000:]
        report = rank.report
        assert report["worker_cls"] == "vllm.v1.worker.cpu_worker.CPUWorker"  # what vLLM would run on this CPU
        assert report["tp"] == [2, rank.rank]
        assert report["layers"] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        assert report["wrapped"] and report["checked"], report  # the check ran inside vLLM's method
        assert report["layouts"], report  # vLLM's own answer, passed through
        summary = "CPU_ATTN (2 layers)"  # vLLM's own backend, which this rank joined the collective with
        assert report["rows"] == [[agreement.LAYERS_LABEL, summary, summary, None]]
        assert "RankMismatchError" not in rank.stderr and "differ across ranks" not in rank.stderr
        assert not rank.leftover, rank.leftover


def test_a_rank_with_an_extra_plugin_stops_both_ranks_with_one_error(cases: dict[str, list[Rank]]) -> None:
    _skip_without_a_worker(cases["extra"])
    messages = []
    for rank in cases["extra"]:
        assert rank.returncode not in (0, None) and not rank.timed_out, rank.stderr[-4000:]
        assert "REPORT " not in rank.stdout  # vLLM's method raised: the worker does not start
        lines = rank.mismatch_lines()
        assert lines, f"rank {rank.rank} did not stop with the agreement error:\n{rank.stderr[-4000:]}"
        assert "in get_supported_kv_cache_layouts" in rank.stderr  # raised where vLLM's workers start
        messages += lines
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
    message = messages[0]
    assert "rank(s) 1 vs rank 0" in message
    assert "plugin 'acme' (distribution acme-attn 1.2) extra (loaded; rank 0 has no such plugin)" in message
    assert "extra backends: cpu_attn" in message
    layers = agreement.LAYERS_LABEL
    for role in ("prefill", "decode"):
        assert (
            f"{layers} resolved {role} 'CPU_ATTN [attnhost cpu_attn] (2 layers)' on rank 1, "
            "'CPU_ATTN (2 layers)' on rank 0"
        ) in message
    assert "install the same plugin packages on every rank" in message


def test_disagreeing_ranks_stop_within_a_bound_and_leave_nothing_behind(cases: dict[str, list[Rank]]) -> None:
    for rank in cases["extra"]:
        assert not rank.timed_out and rank.seconds < TIMEOUT, (rank.rank, rank.seconds)
        assert not rank.leftover, f"rank {rank.rank} left processes behind (killed): {rank.leftover}"
    for ranks in cases.values():
        for rank in ranks:
            assert not _group(rank.pid), f"rank {rank.rank}'s process group is still alive"


def test_the_wrapper_is_installed_once_and_keeps_vllms_method() -> None:
    import inspect

    from vllm.v1.worker.worker_base import WorkerBase

    installed = WorkerBase.__dict__["get_supported_kv_cache_layouts"]  # by vLLM's own plugin loader (conftest)
    assert getattr(installed, "__attnhost_agreement__", False)
    vllms = installed.__wrapped__
    assert vllms.__module__ == "vllm.v1.worker.worker_base" and not hasattr(vllms, "__attnhost_agreement__")
    assert inspect.signature(installed) == inspect.signature(vllms)
    assert (installed.__name__, installed.__qualname__, installed.__doc__) == (
        vllms.__name__,
        vllms.__qualname__,
        vllms.__doc__,
    )
    agreement.install_agreement_check()
    agreement.install_agreement_check()
    assert WorkerBase.__dict__["get_supported_kv_cache_layouts"] is installed  # never wrapped twice
    assert not any(type(finder).__name__ == "_WrapOnImport" for finder in sys.meta_path)


DEFERRED = """
import sys
from vllm.plugins import load_general_plugins

load_general_plugins()  # as vLLM's front end does, before any worker module is imported
before = "vllm.v1.worker.worker_base" in sys.modules
import vllm.v1.worker.worker_base as worker_base

method = worker_base.WorkerBase.get_supported_kv_cache_layouts
hooks = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_WrapOnImport"]
print(before, getattr(method, "__attnhost_agreement__", False), method.__wrapped__.__module__, hooks)
"""


def test_register_before_vllms_worker_module_wraps_it_when_it_is_imported() -> None:
    """``register()`` does not import the worker module (seconds of imports); its first import is wrapped."""
    done = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "False True vllm.v1.worker.worker_base []", done.stdout


def test_layers_are_reported_by_vllm_name_with_the_attnhost_backend_they_run(tiny_model: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = EngineArgs(model=tiny_model, skip_tokenizer_init=True, max_model_len=256).create_engine_config()
    assert agreement.layer_rows(config) == ()  # no model built: nothing to compare, and no row
    torch_native = AttentionBackendEnum.TORCH_NATIVE.get_class()
    with set_current_vllm_config(config):
        for i, backend in enumerate((None, torch_native, torch_native)):  # None: vLLM's selector (CPU_ATTN)
            Attention(4, 16, 0.25, num_kv_heads=2, prefix=f"model.layers.{i}.self_attn.attn", attn_backend=backend)
    summary = "CPU_ATTN (1 layer), TORCH_NATIVE [attnhost torch_native] (2 layers)"
    assert agreement.layer_rows(config) == ((agreement.LAYERS_LABEL, summary, summary, None),)
