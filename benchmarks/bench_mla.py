"""MLA decode on SGLang's latent pool: attnhost's ``torch_native`` through the adapter and called directly, and the
example ``batched_matmul``, as a share of a single-thread memory stream, with the adapter's overhead.

    python benchmarks/bench_mla.py [--quick] [--dtype float32|bfloat16]
                                             (in the `sglang` tox environment's Python, which has SGLang)

The batch is SGLang's own MLA test kit's (``build_mla_attention_fixture``: a real ``MLATokenToKVPool``,
``ReqToTokenPool`` and DeepSeek-style ``RadixAttention`` absorbed layer, each request's prefix latent rows written
by the kit, slots laid out as ``shuffled_pages``): decode, 16 requests x 4,096 tokens, 16 heads, latent 512 + rope
64 (``--quick``: 4 x 1,024). Every query attends over its request's cached rows through the one latent KV head, as
SGLang's kit calls it (``k = v = None``, ``save_kv_cache=False``). Subjects, each built by name from SGLang's
``ATTENTION_BACKENDS`` for the kit's model runner:

* ``adapter``: ``attnhost_torch_native``, SGLang's interface through attnhost's MLA adapter;
* ``direct``: the attnhost backend inside that adapter, called with the batch and layer the adapter built;
* ``batched_matmul``: the example (examples/attnhost-batched), when it declares ``BackendCapabilities.mla``;
  otherwise the line says it is skipped, with SGLang's refusal.

Each subject's output is first checked against a float64 reference computed here from the pool's own rows.
Figures, all on one thread:

* **time per layer**: one decode call of one layer, the subjects interleaved (A, B, C, A, B, C, ...), median;
* **bandwidth**: the latent bytes a decode must read (every cached row once: the values are the rows' first
  ``kv_lora_rank`` columns), per second, as a share of a single-thread streaming read (``torch.sum``) of a buffer
  far beyond the last-level cache, timed in interleaved (stream, subject) pairs (``_common.bandwidth_pairs``);
* **adapter overhead**: the adapter's ``forward`` around a backend that returns at once, minus that backend
  called directly, over the direct ``torch_native`` call (target <= 3 %). Two multi-millisecond calls on a shared
  machine differ by more than the microseconds being measured; the no-op pair does not.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from attnhost_sglang_cpu import shim  # noqa: E402  (the test-only SGLang CPU kit, testkits/attnhost-sglang-cpu)

shim.install()  # SGLang imports torchvision at module level, and PyPI's torchvision cannot import beside the CPU torch

import torch  # noqa: E402
from _common import (  # noqa: E402
    bandwidth_pairs,
    interleaved,
    noop_backend,
    per_call,
    stream_buffer,
    torch_threads,
)

HEADS, KV_LORA_RANK, ROPE = 16, 512, 64
BRIDGED = "attnhost_torch_native"
EXAMPLE = "batched_matmul"


class Setup:
    """One decode batch of SGLang's MLA kit, and every subject built for its runner."""

    def __init__(self, requests: int, context: int, dtype: torch.dtype) -> None:
        from attnhost_sglang_cpu.dense import KitCase
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
            MLAAttentionCase,
            build_mla_attention_fixture,
        )

        from attnhost import UnsupportedFeatureError

        case = MLAAttentionCase(
            name=f"mla decode b={requests} ctx={context}",
            backend=BRIDGED,
            forward_mode=ForwardMode.DECODE,
            num_heads=HEADS,
            page_size=1,
            prefix_lens=(context - 1,) * requests,
        )
        with torch.no_grad():
            fixture = build_mla_attention_fixture(
                KitCase(),
                case,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=ROPE,
                max_context_len=context + 1,
                dtype=dtype,
                device="cpu",
                loc_layout="shuffled_pages",
            )
        self.runner, self.batch, self.layer = fixture.runner, fixture.forward_batch, fixture.actual_module.attn_mqa
        width = KV_LORA_RANK + ROPE
        self.q = torch.randn(requests, HEADS * width, dtype=dtype)  # flat, as RadixAttention hands it on
        self.latent_bytes = sum(case.seq_lens) * width * torch.empty((), dtype=dtype).element_size()
        self.bridge = fixture.backend
        self.example: Any = None
        self.skipped = ""
        try:
            self.example = ATTENTION_BACKENDS[EXAMPLE](self.runner)
        except UnsupportedFeatureError as error:  # the adapter refuses, when built, a backend without ``mla``
            self.skipped = str(error)
        expected = self._reference(case.seq_lens)
        with torch.no_grad():
            for backend in (self.bridge, self.example):
                if backend is None:
                    continue
                backend.init_forward_metadata(self.batch)
                got = backend.forward(self.q, None, None, self.layer, self.batch, save_kv_cache=False)
                tolerance = 2e-4 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
        self.inner = self.bridge.attnhost_backend
        self.attnhost_batch, self.mla_layer = self.bridge._batch, self.bridge._mla_layers[self.layer]
        flat = self.inner.capabilities.flat_heads
        self.direct_q = self.q if flat else self.q.view(requests, HEADS, width)  # what the adapter passes on

    def _reference(self, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """softmax(q K^T * scaling) V per request in float64, K its cached latent rows, V their first columns."""
        latent = self.runner.token_to_kv_pool.get_key_buffer(self.layer.layer_id)
        table = self.runner.req_to_token_pool.req_to_token
        width = KV_LORA_RANK + ROPE
        out = []
        for i, seq in enumerate(seq_lens):
            rows = latent[table[i, :seq].long()].reshape(seq, width).double()
            scores = self.q[i].view(HEADS, width).double() @ rows.T * self.layer.scaling
            out.append(torch.softmax(scores, -1) @ rows[:, :KV_LORA_RANK])
        return torch.stack(out).reshape(len(seq_lens), HEADS * KV_LORA_RANK)

    def subjects(self) -> dict[str, Callable[[], object]]:
        args = (self.q, None, None, self.layer, self.batch)
        direct = (self.direct_q, None, None, self.mla_layer, self.attnhost_batch, False, None, None)
        subjects: dict[str, Callable[[], object]] = {
            f"{BRIDGED} (adapter)": lambda: self.bridge.forward(*args, save_kv_cache=False),
            "torch_native (direct)": lambda: self.inner.forward_mla_mqa(*direct),
        }
        if self.example is not None:
            subjects[f"{EXAMPLE} (adapter)"] = lambda: self.example.forward(*args, save_kv_cache=False)
        return subjects

    def adapter_seconds(self, rounds: int) -> float:
        """The adapter's own work per layer call: bridged around a no-op backend, minus the no-op alone."""
        noop = noop_backend()
        args = (self.q, None, None, self.layer, self.batch, False)
        direct = (self.direct_q, None, None, self.mla_layer, self.attnhost_batch, False, None, None)
        self.bridge.attnhost_backend = noop
        try:
            costs = interleaved(
                {
                    "bridged": per_call(self.bridge.forward, 2000, *args),
                    "alone": per_call(noop.forward_mla_mqa, 2000, *direct),
                },
                rounds,
            )
        finally:
            self.bridge.attnhost_backend = self.inner
        return max(0.0, costs["bridged"].median - costs["alone"].median)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 requests x 1,024 tokens and fewer rounds")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    options = parser.parse_args()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    dtype = getattr(torch, options.dtype)
    requests, context = (4, 1024) if options.quick else (16, 4096)
    rounds = 5 if options.quick else 11
    stream = stream_buffer()
    print(
        f"MLA decode, {requests} requests x {context} tokens, {HEADS} heads, latent {KV_LORA_RANK} + rope {ROPE}, "
        f"{options.dtype}, 1 thread; torch {torch.__version__}; load average {os.getloadavg()}"
    )
    with torch.no_grad(), torch_threads(1):
        setup = Setup(requests, context, dtype)
        print(f"latent bytes read per decode: {setup.latent_bytes / 1e6:.1f} MB (checked against float64)")
        if setup.example is None:
            print(f"{EXAMPLE}: skipped, it does not serve MLA here. SGLang's refusal: {setup.skipped}")
        subjects = setup.subjects()
        times = interleaved({name: per_call(fn, 2) for name, fn in subjects.items()}, rounds)
        print(f"{'subject':<34} {'ms/layer':>9} {'spread':>7} {'GB/s':>7} {'stream GB/s':>12} {'of stream':>10}")
        for name, fn in subjects.items():
            share, gbs, stream_gbs = bandwidth_pairs(stream, fn, setup.latent_bytes, rounds)
            print(
                f"{name:<34} {times[name].median * 1e3:>9.2f} {times[name].spread:>7.1%} {gbs:>7.2f} "
                f"{stream_gbs:>12.2f} {share.median:>10.1%}"
            )
        adapter = setup.adapter_seconds(rounds)
        direct = times["torch_native (direct)"].median
        print(
            f"adapter overhead: {adapter * 1e6:.2f} us per layer over torch_native's {direct * 1e3:.2f} ms = "
            f"{adapter / direct:.2%} (target <= 3%)"
        )
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
