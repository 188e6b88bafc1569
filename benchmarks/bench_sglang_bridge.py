"""attnhost's ``torch_native`` inside SGLang, against SGLang's own, on the same SGLang batches and pools.

    python benchmarks/bench_sglang_bridge.py [--quick]      (in the `sglang` tox environment's Python)

Three subjects per case, interleaved (A, B, C, A, B, C, ...) in one process:

* ``sglang``: SGLang 0.5.23's ``TorchNativeAttnBackend``, built by name from
  SGLang's ``ATTENTION_BACKENDS``;
* ``bridge``: ``attnhost_torch_native`` from the same registry — SGLang's
  interface through attnhost's adapter;
* ``direct``: the very attnhost backend inside that adapter, called with
  the attnhost batch and layer the adapter built, on the same tensors.

Batches and pools come from SGLang's own dense test kit
(``build_dense_attention_fixture``: real ``ReqToTokenPool``,
``MHATokenToKVPool`` and ``RadixAttention``, prefix K/V written through
the pool). Slots are laid out as the kit's ``shuffled_pages`` (fragmented,
as a long-running server's are) and ``contiguous`` (a fresh pool). One
figure is the time of one layer's attention call, init excluded; the
per-batch ``init_forward_metadata`` is timed separately as ``init``.
Ratios: ``sglang / bridge`` (speed-up, target >= 2 on decode, >= 1 on
extend) and the adapter's overhead (target <= 3 %).

Speculative cases (``--spec``, also in the full run): target verify as a
chain and as a tree of the same size, and draft-extend-v2, on the kit's
fixtures with SGLang's own EAGLE verify input. SGLang's ``torch_native``
cannot run them (it fails at TARGET_VERIFY), so the columns are the bridge,
the direct call and the adapter's overhead; a last line gives
``torch_native``'s tree verify over its chain verify (target <= 1.2).

The overhead is the adapter's own work per layer — measured by calling the
adapter's ``forward_decode``/``forward_extend`` (what SGLang's ``forward``
routes to) around a backend that returns at once, minus calling that
backend directly — over the time of the direct ``torch_native`` call. The
adapter keeps the path ``torch_native`` declared (``flat_heads``: SGLang's
tensors passed through) with the no-op inside it. On a shared machine,
``bridge / direct`` of two multi-millisecond calls moves by more than the
few microseconds being measured; the no-op pair does not.
"""

from __future__ import annotations

import argparse
import os
import sys
import unittest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from attnhost_sglang_cpu import shim  # noqa: E402  (the test-only kit, testkits/attnhost-sglang-cpu)

shim.install()  # SGLang imports torchvision at module level (see the kit's shim)

import torch  # noqa: E402
from _common import interleaved, noop_backend, per_call  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


class _Case(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass


def dense_fixture(
    label: str,
    mode: str,
    prefix: tuple[int, ...],
    extend: tuple[int, ...],
    layout: str,
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
    *,
    page_size: int = 1,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
) -> Any:
    """SGLang's dense-kit fixture for one batch (its pools, batch, layer and SGLang's own ``torch_native``);
    ``heads``: query heads, KV heads, head dim; ``page_size``: SGLang's ``--page-size``; ``dtype``: the model's;
    ``kv_dtype``: an FP8 cache (SGLang's own FP8 pool, through the kit's ``fp8_fixture``, scales 1), else the
    model's dtype."""
    num_heads, num_kv_heads, head_dim = heads
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
        DenseAttentionCase,
        build_dense_attention_fixture,
    )

    case = DenseAttentionCase(
        name=label,
        backend="torch_native",
        forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        prefix_lens=prefix,
        extend_lens=extend,
    )
    # SGLang's kit gives request i the slots from page_size + i * max_context_len on: a whole number of pages
    # each, or a request's pages would straddle two of the pool's (which SGLang's paged allocator never does)
    context = max(p + max(extend or (1,)) for p in prefix) + 1
    options = {
        "head_dim": head_dim,
        "hidden_size": num_heads * head_dim,
        "max_context_len": -(-context // page_size) * page_size,
        "loc_layout": layout,
    }
    if kv_dtype is not None and kv_dtype != dtype:
        from attnhost_sglang_cpu.dense import fp8_fixture

        return fp8_fixture(case, kv_dtype, dtype=dtype, **options)
    with torch.no_grad():
        return build_dense_attention_fixture(_Case(), case, dtype=dtype, device="cpu", **options)


def _cases(quick: bool) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    """(label, mode, prefix_lens, extend_lens)."""
    contexts = (512, 4096) if quick else (512, 1024, 4096)
    batches = (1, 16) if quick else (1, 16, 64)
    cases = [
        (f"decode b={b} ctx={ctx}", "decode", (ctx - 1,) * b, ())
        for b in batches
        for ctx in contexts
        if b * ctx <= 64 * 4096
    ]
    cases.append(("extend b=4 new=512 no prefix", "extend", (0,) * 4, (512,) * 4))
    cases.append(("extend b=4 new=128 prefix=1024", "extend", (1024,) * 4, (128,) * 4))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and rounds")
    parser.add_argument("--layout", choices=("shuffled_pages", "contiguous", "both"), default="both")
    parser.add_argument("--only", default="", help="run only the cases whose label contains this text")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 5 with --quick, else 9)")
    parser.add_argument("--spec", action="store_true", help="only the speculative (verify, draft-extend) cases")
    options = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    layouts = ("shuffled_pages", "contiguous") if options.layout == "both" else (options.layout,)
    rounds = options.rounds or (5 if options.quick else 9)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; heads {HEADS}/{KV_HEADS}, dim {HEAD_DIM}")
    print(
        f"{'case':<34} {'layout':<15} {'sglang':>10} {'bridge':>10} {'direct':>10} {'speed-up':>9} {'overhead':>9}"
        f" {'adapter':>9}"
    )
    worst_overhead, worst = 0.0, {"decode": float("inf"), "extend": float("inf")}
    for layout in layouts if not options.spec else ():
        for label, mode, prefix, extend in _cases(options.quick):
            if options.only not in label:
                continue
            fixture = dense_fixture(label, mode, prefix, extend, layout)
            case = fixture.case
            runner, batch = fixture.runner, fixture.forward_batch
            layer = fixture.actual_module.attn
            sglang_backend = fixture.backend
            bridge = ATTENTION_BACKENDS["attnhost_torch_native"](runner)
            tokens = case.num_input_tokens
            q = torch.randn(tokens, HEADS * HEAD_DIM)
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM)  # as RadixAttention hands them to a backend
            v = torch.randn(tokens, KV_HEADS, HEAD_DIM)
            sglang_backend.init_forward_metadata(batch)
            bridge.init_forward_metadata(batch)
            inner, attnhost_batch = bridge.attnhost_backend, bridge._batch
            bridge.forward(q, k, v, layer, batch)  # converts the layer once, as the first forward does
            attnhost_layer = bridge._layers[layer.layer_id]
            q3 = q.view(tokens, HEADS, HEAD_DIM)
            direct_method = inner.forward_decode if mode == "decode" else inner.forward_extend
            number = max(3, int(3e5 // (sum(prefix) + tokens + 1)))
            with torch.no_grad():
                torch.testing.assert_close(
                    bridge.forward(q, k, v, layer, batch),
                    sglang_backend.forward(q, k, v, layer, batch),
                    atol=2e-4,
                    rtol=2e-4,
                )
                stats = interleaved(
                    {
                        "sglang": per_call(sglang_backend.forward, number, q, k, v, layer, batch),
                        "bridge": per_call(bridge.forward, number, q, k, v, layer, batch),
                        "direct": per_call(direct_method, number, q3, k, v, attnhost_layer, attnhost_batch),
                    },
                    rounds,
                )
                real_inner = bridge.attnhost_backend
                noop = noop_backend()
                bridge.attnhost_backend = noop
                noop_method = noop.forward_decode if mode == "decode" else noop.forward_extend
                # SGLang's own forward() routing (and its debug decorator) is paid by every SGLang backend:
                # the adapter's cost starts at the method SGLang routes to.
                bridged = bridge.forward_decode if mode == "decode" else bridge.forward_extend
                costs = interleaved(
                    {
                        "bridged": per_call(bridged, 2000, q, k, v, layer, batch),
                        "alone": per_call(noop_method, 2000, q3, k, v, attnhost_layer, attnhost_batch),
                    },
                    rounds,
                )
                bridge.attnhost_backend = real_inner
            s, b, d = (stats[name].median for name in ("sglang", "bridge", "direct"))
            adapter = max(0.0, costs["bridged"].median - costs["alone"].median)
            speed_up, overhead = s / b, 1 + adapter / d
            worst[mode] = min(worst[mode], speed_up)
            worst_overhead = max(worst_overhead, overhead)
            print(
                f"{label:<34} {layout:<15} {s * 1e6:>8.0f}us {b * 1e6:>8.0f}us {d * 1e6:>8.0f}us "
                f"{speed_up:>8.2f}x {overhead:>8.3f} {adapter * 1e6:>7.1f}us"
            )
    print(
        f"worst speed-up: decode {worst['decode']:.2f}x (target >= 2), extend {worst['extend']:.2f}x (target >= 1); "
        f"worst adapter overhead {worst_overhead:.3f} (target <= 1.03)"
    )
    _speculative(options, rounds)
    return 0


# (label, prefix_lens, draft tokens per request, topk): chains and trees of the same size side by side.
SPEC_CASES = [
    ("b=16 ctx=1024 draft=4", (1024,) * 16, 4),
    ("b=4 ctx=4096 draft=8", (4096,) * 4, 8),
    ("b=1 ctx=4096 draft=8", (4096,), 8),
]


def _tree_mask(prefix: tuple[int, ...], draft_tokens: int) -> torch.Tensor:
    """An EAGLE-like tree in SGLang's FULL_MASK layout: token j's parent is j - 1 or j - 2 (two branches)."""
    g = torch.Generator().manual_seed(0)
    blocks = []
    for seq in prefix:
        block = torch.eye(draft_tokens, dtype=torch.bool)
        for j in range(1, draft_tokens):
            parent = max(0, j - 1 - int(torch.randint(0, 2, (1,), generator=g)))
            block[j] |= block[parent]
        blocks.append(torch.cat([torch.ones(draft_tokens, seq, dtype=torch.bool), block], dim=1).reshape(-1))
    return torch.cat(blocks)


def _speculative(options: argparse.Namespace, rounds: int) -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
        DenseAttentionCase,
        build_dense_attention_fixture,
    )
    from sglang.test.kits.attention_unittest.runner_modes.speculative_draft_extend_runner import (
        _prepare_eagle_draft_extend_v2_batch,
    )
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        _make_eagle_verify_input,
        _prepare_target_verify_batch,
    )

    print(f"\n{'speculative case':<40} {'bridge':>10} {'direct':>10} {'overhead':>9} {'adapter':>9}")
    worst_overhead, tree_over_chain = 0.0, 0.0
    for label, prefix, draft_tokens in SPEC_CASES:
        medians: dict[str, float] = {}
        for kind in ("verify chain", "verify tree", "draft-extend"):
            full_label = f"{kind} {label}"
            if options.only not in full_label:
                continue
            mode = ForwardMode.DRAFT_EXTEND_V2 if kind == "draft-extend" else ForwardMode.TARGET_VERIFY
            case = DenseAttentionCase(
                name=full_label,
                backend="attnhost_torch_native",
                forward_mode=mode,
                num_heads=HEADS,
                num_kv_heads=KV_HEADS,
                page_size=1,
                prefix_lens=prefix,
                extend_lens=(draft_tokens,) * len(prefix),
            )
            with torch.no_grad():
                build = case if mode is ForwardMode.TARGET_VERIFY else _replace_mode(case, ForwardMode.EXTEND)
                fixture = build_dense_attention_fixture(
                    _Case(),
                    build,
                    head_dim=HEAD_DIM,
                    hidden_size=HEADS * HEAD_DIM,
                    max_context_len=max(prefix) + draft_tokens + 1,
                    dtype=torch.float32,
                    device="cpu",
                    loc_layout="shuffled_pages",
                )
            batch = fixture.forward_batch
            if mode is ForwardMode.TARGET_VERIFY:
                _prepare_target_verify_batch(batch, case, "cpu")
                batch.spec_info = _make_eagle_verify_input(case, batch, topk=1, device="cpu")
                if kind == "verify tree":
                    batch.spec_info.topk = 2
                    batch.spec_info.custom_mask = _tree_mask(prefix, draft_tokens)
            else:
                batch.forward_mode = mode
                _prepare_eagle_draft_extend_v2_batch(case, batch, device="cpu")
            bridge = ATTENTION_BACKENDS["attnhost_torch_native"](fixture.runner)
            medians[kind], direct, overhead, adapter = _time_bridge(bridge, fixture, rounds)
            worst_overhead = max(worst_overhead, overhead)
            print(
                f"{full_label:<40} {medians[kind] * 1e6:>8.0f}us {direct * 1e6:>8.0f}us "
                f"{overhead:>8.3f} {adapter * 1e6:>7.1f}us"
            )
        if "verify chain" in medians and "verify tree" in medians:
            ratio = medians["verify tree"] / medians["verify chain"]
            tree_over_chain = max(tree_over_chain, ratio)
            print(f"{'  tree / chain, ' + label:<40} {ratio:>10.2f}")
    print(
        f"speculative: worst adapter overhead {worst_overhead:.3f} (target <= 1.03), "
        f"worst torch_native tree / chain verify {tree_over_chain:.2f} (target <= 1.2)"
    )


def _replace_mode(case: object, mode: object) -> object:
    import dataclasses

    return dataclasses.replace(case, forward_mode=mode)  # type: ignore[type-var]


def _time_bridge(bridge: object, fixture: object, rounds: int) -> tuple[float, float, float, float]:
    """(bridged, direct, overhead ratio, adapter seconds) for one speculative batch, measured as the main table."""
    batch, layer = fixture.forward_batch, fixture.actual_module.attn  # type: ignore[attr-defined]
    tokens = int(batch.out_cache_loc.numel())
    q = torch.randn(tokens, HEADS * HEAD_DIM)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM)
    bridge.init_forward_metadata(batch)  # type: ignore[attr-defined]
    with torch.no_grad():
        bridge.forward(q, k, v, layer, batch)  # type: ignore[attr-defined]
        inner, attnhost_batch = bridge.attnhost_backend, bridge._batch  # type: ignore[attr-defined]
        attnhost_layer = bridge._layers[layer.layer_id]  # type: ignore[attr-defined]
        q3 = q.view(tokens, HEADS, HEAD_DIM)
        number = max(3, int(3e5 // (int(batch.seq_lens_cpu.sum()) + tokens + 1)))
        stats = interleaved(
            {
                "bridge": per_call(bridge.forward_extend, number, q, k, v, layer, batch),  # type: ignore[attr-defined]
                "direct": per_call(inner.forward_extend, number, q3, k, v, attnhost_layer, attnhost_batch),
            },
            rounds,
        )
        noop = noop_backend()
        bridge.attnhost_backend = noop  # type: ignore[attr-defined]
        costs = interleaved(
            {
                "bridged": per_call(bridge.forward_extend, 2000, q, k, v, layer, batch),  # type: ignore[attr-defined]
                "alone": per_call(noop.forward_extend, 2000, q3, k, v, attnhost_layer, attnhost_batch),  # type: ignore[attr-defined]
            },
            rounds,
        )
        bridge.attnhost_backend = inner  # type: ignore[attr-defined]
    adapter = max(0.0, costs["bridged"].median - costs["alone"].median)
    direct = stats["direct"].median
    return stats["bridge"].median, direct, 1 + adapter / direct, adapter


if __name__ == "__main__":
    raise SystemExit(main())
