"""Decode inside SGLang's CPU graph runner (``torch.compile``) against the eager run, same backend, and the adapter's
per-batch host time.

    python benchmarks/bench_sglang_graphs.py [--quick]      (in the `sglang` tox environment's Python)

1. **Decode tokens/s**, one real ``sglang.Engine`` per subject on the test platform (its graph variant, which
   returns SGLang's ``CPUGraphRunner``), a seeded Llama of width 512, 4 layers, 8 heads / 2 KV heads, float32:
   each graph-capable backend (``batched_matmul``, Python; ``cpu_paged``, the compiled example) eagerly
   (``--disable-cuda-graph``) and inside the CPU graph runner with ``--enable-torch-compile`` (captured sizes 1, 2,
   4), at batch 1 and 4. Each engine first generates once (warm-up, and the graphs' compilation), then the timed
   generations: decode tokens per second over ``NEW_TOKENS`` new tokens a request, the prefill of a few tokens
   included, ``--context-length`` :data:`CONTEXT`. The ratio is graph / eager.
   ``attnhost_torch_native`` declares no graph support (SGLang switches graphs off for its own ``torch_native``
   too), so SGLang runs it eagerly whatever it is asked; its eager figure is printed beside for scale.
2. **The adapter's per-batch host time** (``init_forward_metadata`` of SGLang's adapter on the kit's dense decode
   batch of 4 requests, ``batched_matmul`` inside, median of interleaved calls): run this script at two commits
   back to back to compare (the figure before and after the sync-free checks is in the closing note of that change).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, Stats, interleaved, machine, per_call

NEW_TOKENS = 32
GRAPH_CAPABLE = ("batched_matmul", "cpu_paged")
CONTEXT = 128
"""The engines' ``--context-length``: a captured graph plans every request to it (the host's bound), so a backend
without a variable-length kernel, as ``batched_matmul``, pays for it in every decode step; this one is a few times
what the requests use (BENCHMARKS.md has the figures at a longer context too)."""
SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}

_ENGINE = r"""
import json, sys, time
from attnhost_sglang_cpu import shim

shim.install()  # at module level: SGLang's spawned scheduler re-imports this file and needs the shim too


def main():
    import sglang as sgl

    model, backend = sys.argv[1], sys.argv[2]
    bs, graphs, rounds, new = int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6])
    if graphs:
        args = {"cuda_graph_bs_decode": [1, 2, 4], "enable_torch_compile": True, "torch_compile_max_bs": 4}
    else:
        args = {"disable_cuda_graph": True}
    engine = sgl.Engine(
        model_path=model, attention_backend=backend, device="cpu", dtype="float32", random_seed=0,
        log_level="error", max_total_tokens=4096, context_length=int(sys.argv[7]), **args,
    )
    prompts = [[1, 5 + i, 9, 13 + i, 21] for i in range(bs)]
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=params)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        times.append(time.perf_counter() - start)
    engine.shutdown()
    print("RESULT " + json.dumps({"times": times, "ids": [o["output_ids"] for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
"""


def _model(root: Path) -> Path:
    from attnhost_hf_models.llama import VOCAB, build_model

    path = root / "llama-512"
    build_model(path, {**SHAPE, "vocab_size": VOCAB})
    return path


def engine_tokens_per_second(model: Path, backend: str, bs: int, graphs: bool, rounds: int) -> tuple[Stats, Any]:
    """One engine in its own process: decode tokens/s of its timed generations, and its output ids."""
    from attnhost_sglang_cpu import sglang_env

    env = sglang_env({"ATTNHOST_TEST_CPU_GRAPHS": "1"})
    script = model.parent / "engine.py"
    script.write_text(_ENGINE)
    cmd = [sys.executable, str(script), str(model), backend, str(bs), "1" if graphs else "0", str(rounds)]
    cmd += [str(NEW_TOKENS), str(CONTEXT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=REPO)
    line = next((li for li in proc.stdout.splitlines() if li.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{backend} bs={bs} graphs={graphs}: the engine failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    return Stats.of([bs * NEW_TOKENS / t for t in result["times"]]), result["ids"]


def adapter_host_time(rounds: int) -> Stats:
    """``init_forward_metadata`` of SGLang's adapter over ``batched_matmul``, a 4-request decode batch (us)."""
    os.environ.setdefault("SGLANG_PLATFORM", "attnhost_test_cpu")
    from attnhost_sglang_cpu import shim

    shim.install()
    import unittest

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins import load_plugins
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
        DenseAttentionCase,
        build_dense_attention_fixture,
    )

    load_plugins()
    case = DenseAttentionCase(
        name="decode",
        backend="batched_matmul",
        forward_mode=ForwardMode.DECODE,
        num_heads=8,
        num_kv_heads=2,
        page_size=1,
        prefix_lens=(40, 17, 55, 23),
        extend_lens=(),
    )
    with torch.no_grad():
        fixture = build_dense_attention_fixture(unittest.TestCase(), case, device="cpu", dtype=torch.float32)
    plan = per_call(fixture.backend.init_forward_metadata, 50, fixture.forward_batch)
    return interleaved({"init": plan}, rounds)["init"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, noisier figures)")
    args = parser.parse_args()
    rounds = 3 if args.quick else 7
    print(json.dumps(machine()))
    host = adapter_host_time(rounds * 3)
    print(
        f"adapter init_forward_metadata, decode of 4 (batched_matmul): {host.median * 1e6:.1f} us (+-{host.spread:.0%})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp))
        print(f"{'backend':24} {'bs':>3} {'eager tok/s':>12} {'graph tok/s':>12} {'graph / eager':>14}")
        for bs in (1, 4):
            for backend in GRAPH_CAPABLE:
                eager, eager_ids = engine_tokens_per_second(model, backend, bs, False, rounds)
                graph, graph_ids = engine_tokens_per_second(model, backend, bs, True, rounds)
                same = "same ids" if eager_ids == graph_ids else "IDS DIFFER"
                ratio = graph.median / eager.median
                print(f"{backend:24} {bs:>3} {eager.median:>12.1f} {graph.median:>12.1f} {ratio:>13.2f}x  {same}")
            other, _ = engine_tokens_per_second(model, "attnhost_torch_native", bs, False, rounds)
            print(f"{'attnhost_torch_native':24} {bs:>3} {other.median:>12.1f} {'(no graphs)':>12}")


if __name__ == "__main__":
    main()
