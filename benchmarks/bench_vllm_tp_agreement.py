"""What the rank-agreement check costs a vLLM worker's start-up with ``tensor_parallel_size=2``.

    VLLM_TARGET_DEVICE=cpu python benchmarks/bench_vllm_tp_agreement.py [--rounds N]

In the ``vllm`` tox environment's Python (vLLM 0.33 and attnhost installed, or ``PYTHONPATH=core:plugins``);
not part of ``benchmarks/run.py``, which runs without vLLM.

Two rank processes go through vLLM's worker start-up as far as this CPU allows, as
``tests/vllm/test_tensor_parallel.py`` does: ``WorkerWrapperBase.init_worker`` (vLLM's general plugins,
attnhost's included), ``CPUWorker.init_device`` (gloo process groups, the CPU model runner) and
``load_model`` of a two-layer Llama with dummy weights, which builds the model and stops where the PyPI
wheel lacks ``vllm._C``. Each rank then times:

* **start-up**: all of that, from the rank's first vLLM import to the hooked call;
* **hooked call**: the one ``get_supported_kv_cache_layouts`` call that carries the check (vLLM's method,
  reading the layers, the fingerprint, one gloo ``all_gather_object``);
* **vLLM's method alone**: the method attnhost wraps (``__wrapped__``), repeated;
* **the check alone**: what the wrapper adds (``layer_rows`` and ``check_ranks_agree`` on
  ``get_tp_group().cpu_group``), repeated N times in lockstep on both ranks; its median on the slower rank
  is the figure compared with start-up.

The start-up measured here lacks what a real start adds after the check (the profiling forward, the KV
cache, warm-up or CUDA-graph capture) and a model's real weights, so the share printed is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnhost_vllm_cpu.config import TINY_LLAMA  # the test-only vLLM kit's tiny Llama


def rank_main(rank: int, port: str, model: str, rounds: int) -> None:
    """One rank: vLLM's worker start-up, then the timings; prints one JSON line."""
    started = time.perf_counter()
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.worker_base import WorkerBase, WorkerWrapperBase

    config = EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=256,
        load_format="dummy",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        distributed_timeout_seconds=120,
    ).create_engine_config()
    config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"  # CPUWorker.__init__ needs vllm._C
    wrapper = WorkerWrapperBase(rpc_rank=rank, global_rank=rank)
    all_kwargs: list[dict[str, object]] = [{}, {}]
    all_kwargs[rank] = {
        "vllm_config": config,
        "local_rank": rank,
        "rank": rank,
        "distributed_init_method": f"tcp://127.0.0.1:{port}",
        "is_driver_worker": rank == 0,
    }
    wrapper.init_worker(all_kwargs)
    with set_current_vllm_config(config):
        CPUWorker.init_device(wrapper.worker)
    with contextlib.suppress(ImportError, AttributeError):  # the model is built; its weights need vllm._C
        wrapper.load_model()
    startup = time.perf_counter() - started

    method = WorkerBase.get_supported_kv_cache_layouts
    if not getattr(method, "__attnhost_agreement__", False):
        raise SystemExit("attnhost's agreement check is not installed (is attnhost on the path?)")
    t0 = time.perf_counter()
    run_method(wrapper, "get_supported_kv_cache_layouts", (), {})
    hooked = time.perf_counter() - t0

    from vllm.distributed.parallel_state import get_tp_group

    from attnhost.distributed import check_ranks_agree
    from attnhost.engines.vllm.agreement import layer_rows

    vllms = method.__wrapped__
    group = get_tp_group().cpu_group
    alone, checks = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        vllms(wrapper.worker)
        alone.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        check_ranks_agree(group=group, runners=layer_rows(config))
        checks.append(time.perf_counter() - t0)
    figures = {"startup": startup, "hooked": hooked, "method": statistics.median(alone)}
    print(json.dumps({**figures, "check": statistics.median(checks)}), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50, help="repetitions of the check on both ranks (50)")
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp(prefix="bench-vllm-tp-"))
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    port = str(_free_port())
    cmd = [sys.executable, __file__, "--rank"]
    procs = [
        subprocess.Popen(
            [*cmd, str(rank), port, str(model), str(args.rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    ranks = []
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=600)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"rank {rank} failed:\n{stderr[-4000:]}")
            ranks.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    for rank, r in enumerate(ranks):
        print(
            f"rank {rank}: start-up {r['startup']:6.2f} s; hooked call {r['hooked'] * 1e3:7.2f} ms "
            "(with waiting for the other rank); "
            f"vLLM's method alone {r['method'] * 1e3:6.3f} ms; the check alone {r['check'] * 1e3:6.2f} ms "
            f"(median of {args.rounds})"
        )
    check = max(r["check"] for r in ranks)
    startup = min(r["startup"] for r in ranks)
    print(f"the check (slower rank's median): {check * 1e3:.2f} ms = {check / startup:.4%} of the worker start-up")
    print("measured here (up to the hooked call, without profiling, KV cache or warm-up: an upper bound)")
    print(f"target <= 1 %: {'met' if check / startup <= 0.01 else 'MISSED'}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
