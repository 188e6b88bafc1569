"""``batched_matmul``'s attention variants (docs/variants.md) against the float64 reference, in every forward mode.

Each case fills a KV cache by hand, runs one batch through the public path (a ``ModelRunner``, its forward context,
``backend.forward``) and compares with ``attnhost.testing.reference.reference_attention``, which shares no code with
the backend. Where the window must keep a query from reading a key at all, the keys outside it are overwritten with
NaN after the reference's snapshot: a backend that gathered and merely masked them would return NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from attnhost_batched.backend import BatchedMatmulAttnBackend

from attnhost import AttentionLayer, ForwardMode, ModelRunner, ServerArgs
from attnhost.forward_batch import ForwardBatch
from attnhost.testing.reference import reference_attention, tree_mask

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEAD_DIM = 16

#: ``id: AttentionLayer keyword arguments`` (sinks: ``has_sinks``, the test passes the logits): each variant alone,
#: then combined.
VARIANTS: dict[str, dict[str, Any]] = {
    "window": {"sliding_window_size": 3},
    "cap": {"logit_cap": 0.8},
    "sinks": {"has_sinks": True},
    "non_causal": {"is_causal": False},
    "window+cap": {"sliding_window_size": 2, "logit_cap": 1.5},
    "window+sinks": {"sliding_window_size": 4, "has_sinks": True},
    "window+non_causal": {"sliding_window_size": 2, "is_causal": False},
    "cap+sinks": {"logit_cap": 1.0, "has_sinks": True},
    "sinks+non_causal": {"has_sinks": True, "is_causal": False},
    "all": {"sliding_window_size": 3, "logit_cap": 1.2, "has_sinks": True, "is_causal": False},
    "window+cap+sinks": {"sliding_window_size": 1, "logit_cap": 0.9, "has_sinks": True},
}

#: ``id: (mode, [(prefix, new), ...])``: every forward mode, mixed prefixes (none, shorter and longer than the
#: windows above, crossing them), all in one batch.
MODES: dict[str, tuple[ForwardMode, list[tuple[int, int]]]] = {
    "extend": (ForwardMode.EXTEND, [(0, 6), (7, 4), (2, 3), (12, 1)]),
    "mixed": (ForwardMode.MIXED, [(5, 5), (9, 1), (0, 2)]),
    "decode": (ForwardMode.DECODE, [(0, 1), (3, 1), (4, 1), (11, 1)]),
    "verify-chain": (ForwardMode.TARGET_VERIFY, [(8, 4), (1, 4)]),
    "draft-extend": (ForwardMode.DRAFT_EXTEND, [(6, 3), (10, 2)]),
    "draft-extend-v2": (ForwardMode.DRAFT_EXTEND_V2, [(6, 4), (3, 4)]),
}


@dataclass
class Case:
    """A runner whose cache holds random prefixes, and one batch over them."""

    runner: ModelRunner
    batch: ForwardBatch
    generator: torch.Generator

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return _randn(self.generator, self.runner.dtype, shape, scale)


def _randn(generator: torch.Generator, dtype: torch.dtype, shape: Sequence[int], scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=generator) * scale).to(dtype)


def _runner(dtype: torch.dtype = torch.float32, heads: int = 4, kv_heads: int = 2) -> ModelRunner:
    args = ServerArgs(attention_backend="batched_matmul")
    return ModelRunner(
        args,
        num_layers=3,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_requests=16,
        max_context_len=64,
        num_slots=512,
        dtype=dtype,
    )


def _case(
    mode: ForwardMode,
    requests: Sequence[tuple[int, int]],
    *,
    dtype: torch.dtype = torch.float32,
    heads: int = 4,
    kv_heads: int = 2,
    tree: torch.Tensor | None = None,
    seed: int = 0,
) -> Case:
    """A batch of ``(prefix, new)`` requests whose prefixes are cached (random K/V in every layer)."""
    runner = _runner(dtype, heads, kv_heads)
    generator = torch.Generator().manual_seed(seed)
    rows = [runner.new_request() for _ in requests]
    prefill = [(row, 0, prefix) for row, (prefix, _) in zip(rows, requests, strict=True) if prefix]
    if prefill:
        cached = ForwardBatch.prepare(runner.kv_pool, ForwardMode.EXTEND, prefill)
        _write(runner, generator, cached.out_cache_loc)
    specs = [(row, prefix, new) for row, (prefix, new) in zip(rows, requests, strict=True)]
    return Case(runner, runner.prepare_batch(mode, specs, tree), generator)


def _write(runner: ModelRunner, generator: torch.Generator, slots: torch.Tensor) -> None:
    """Random K/V at ``slots`` in every layer of ``runner``'s cache."""
    pool = runner.kv_pool
    shape = (slots.numel(), pool.num_kv_heads, pool.head_dim)
    for layer_id in range(pool.num_layers):
        pool.set_kv(layer_id, slots, _randn(generator, pool.dtype, shape), _randn(generator, pool.dtype, shape))


def _layer(case: Case, layer_id: int = 0, **variant: Any) -> AttentionLayer:
    pool = case.runner.kv_pool
    heads = case.runner.layers[0].num_heads
    return AttentionLayer(layer_id, heads, pool.num_kv_heads, pool.head_dim, **variant)


def _sinks(case: Case, layer: AttentionLayer) -> torch.Tensor | None:
    return case.randn(layer.num_heads, scale=2.0) if layer.has_sinks else None


def _run(
    case: Case,
    layer: AttentionLayer,
    *,
    sinks: torch.Tensor | None = None,
    poison: Sequence[tuple[int, int]] = (),
    q_scale: float = 1.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's output and the reference's, for fresh new tokens. ``poison``: ``(request, keys)`` pairs whose
    first ``keys`` cached keys no query may read; they are NaN in the cache the backend sees."""
    batch, pool = case.batch, case.runner.kv_pool
    n = batch.num_new_tokens
    q = case.randn(n, layer.num_heads, layer.head_dim, scale=q_scale)
    k = case.randn(n, layer.num_kv_heads, layer.head_dim)
    v = case.randn(n, layer.num_kv_heads, layer.head_dim)
    pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
    k_snapshot, v_snapshot = pool.k_buffer(layer.layer_id).clone(), pool.v_buffer(layer.layer_id).clone()
    for request, keys in poison:
        slots = pool.req_to_token[int(batch.req_pool_indices[request]), :keys]
        pool.k_buffer(layer.layer_id)[slots] = float("nan")
        pool.v_buffer(layer.layer_id)[slots] = float("nan")
    with torch.no_grad(), case.runner.forward_context() as backend:
        out = backend.forward(q, k, v, layer, batch, sinks=sinks)
    expected = reference_attention(q, layer, batch, k_buffer=k_snapshot, v_buffer=v_snapshot, sinks=sinks)
    return out, expected


def _assert_close(out: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    assert out.shape == expected.shape, f"{label}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    error = (out.to(torch.float64) - expected).abs()
    worst = float(error.nan_to_num(float("inf")).max()) if error.numel() else 0.0
    atol = ATOL[out.dtype]
    assert worst <= atol, f"{label}: max abs error {worst:.3g} exceeds {atol:g} (token, head: {error.argmax()})"


def test_it_declares_the_four_variants_and_refuses_no_layer_that_needs_them() -> None:
    capabilities = BatchedMatmulAttnBackend.capabilities
    assert (capabilities.sliding_window, capabilities.logit_cap, capabilities.sinks, capabilities.non_causal) == (
        True,
        True,
        True,
        True,
    )
    layer = AttentionLayer(0, 4, 2, HEAD_DIM, sliding_window_size=7, logit_cap=30.0, has_sinks=True, is_causal=False)
    assert capabilities.layer_refusal(layer) is None


@pytest.mark.parametrize("mode_id", sorted(MODES))
@pytest.mark.parametrize("variant_id", list(VARIANTS))
def test_each_variant_alone_and_combined_in_every_mode(variant_id: str, mode_id: str) -> None:
    mode, requests = MODES[mode_id]
    case = _case(mode, requests)
    layer = _layer(case, **VARIANTS[variant_id])
    out, expected = _run(case, layer, sinks=_sinks(case, layer))
    _assert_close(out, expected, f"{variant_id} in {mode_id}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("window", [0, 1, 4, 8, 9, 40])
def test_windows_shorter_and_longer_than_the_prefix(window: int, causal: bool) -> None:
    """Prefixes of 9 and 3 tokens: the window ends inside, at the edge of, or beyond each (40: it changes nothing).
    Keys before the window's start are NaN in the cache: the backend must not read them."""
    case = _case(ForwardMode.EXTEND, [(9, 5), (3, 2), (0, 4)])
    layer = _layer(case, sliding_window_size=window, is_causal=causal)
    poison = [(0, max(0, 9 - window)), (1, max(0, 3 - window))]
    out, expected = _run(case, layer, poison=poison)
    _assert_close(out, expected, f"window {window}, {'causal' if causal else 'non-causal'}")


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_decode_at_the_window_edge_reads_only_the_window(sinks: bool) -> None:
    """Window 4 (five keys per query): decodes at sequence lengths 3, 4, 5 (w + 1), 6 (w + 2) and 7. Every key before
    the window is NaN in the cache the backend reads."""
    window = 4
    seqs = (3, 4, window + 1, window + 2, 7)
    case = _case(ForwardMode.DECODE, [(seq - 1, 1) for seq in seqs])
    layer = _layer(case, sliding_window_size=window, has_sinks=sinks)
    poison = [(i, max(0, seq - 1 - window)) for i, seq in enumerate(seqs)]
    out, expected = _run(case, layer, sinks=_sinks(case, layer), poison=poison)
    assert bool(torch.isfinite(out).all()), "decode read a key outside its window (NaN in the output)"
    _assert_close(out, expected, "decode at the window edge")


def test_extend_over_a_cached_prefix_crossing_the_window() -> None:
    """A prefix of 10 under a window of 3: the first new token sees prefix keys 7..9, the last only new tokens; keys
    0..6 are NaN in the cache. A second request's prefix of 2 lies wholly inside the window."""
    case = _case(ForwardMode.EXTEND, [(10, 6), (2, 3)])
    layer = _layer(case, sliding_window_size=3, logit_cap=1.0)
    out, expected = _run(case, layer, poison=[(0, 7)])
    _assert_close(out, expected, "extend over a prefix crossing the window")


@pytest.mark.parametrize("window", [0, 1, 2, 6])
@pytest.mark.parametrize("variant", ["plain", "cap+sinks"])
def test_tree_verify_with_a_window_counts_positions_by_depth(window: int, variant: str) -> None:
    """In a tree a new token's position is the prefix plus its depth, not its index: with a window of 1 token 3 of
    ``(-1, 0, 0, 1, 2, 1)`` (depth 2) still sees its parent (depth 1), though four indices apart."""
    parents = [(-1, 0, 0, 1, 2, 1), (-1, 0, 1, 0, 2, 4), (-1, 0, 0, 1)]
    prefixes = [5, 0, 2]
    case = _case(
        ForwardMode.TARGET_VERIFY,
        [(prefix, len(tree)) for prefix, tree in zip(prefixes, parents, strict=True)],
        tree=tree_mask(*parents),
        heads=8,
        kv_heads=2,
    )
    extra: dict[str, Any] = {"logit_cap": 1.0, "has_sinks": True} if variant == "cap+sinks" else {}
    layer = _layer(case, sliding_window_size=window, **extra)
    poison = [(0, max(0, prefixes[0] - window)), (2, max(0, prefixes[2] - window))]
    out, expected = _run(case, layer, sinks=_sinks(case, layer), poison=poison)
    _assert_close(out, expected, f"tree verify, window {window}, {variant}")


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_a_tree_query_that_its_window_leaves_no_key_gets_zeros(sinks: bool) -> None:
    """Token 1's tree row sees only token 0, not itself: under a window of 0 (a query sees its own position only)
    that is no key at all, prefix or not; it gets zeros, with or without sinks. Token 2 of the second request has
    an all-False row and no prefix."""
    block_a = torch.tensor([[True, False, False], [True, False, False], [True, False, True]])
    block_b = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])
    mask = torch.cat([block_a.flatten(), block_b.flatten()])
    case = _case(ForwardMode.TARGET_VERIFY, [(4, 3), (0, 3)], tree=mask)
    layer = _layer(case, sliding_window_size=0, has_sinks=sinks)
    out, expected = _run(case, layer, sinks=_sinks(case, layer))
    _assert_close(out, expected, "tree rows that see no key")
    assert not bool(out[1].any()) and not bool(out[5].any()), "a query that sees no key must get zeros"
    assert bool(out[0].any()) and bool(out[2].any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("variant_id", ["all", "window+cap+sinks"])
def test_bfloat16_and_head_layouts(variant_id: str, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    case = _case(ForwardMode.EXTEND, [(7, 5), (0, 3), (2, 1)], dtype=dtype, heads=heads, kv_heads=kv_heads)
    layer = _layer(case, **VARIANTS[variant_id])
    out, expected = _run(case, layer, sinks=_sinks(case, layer))
    assert out.dtype == dtype
    _assert_close(out, expected, f"{variant_id}, {heads} heads / {kv_heads} KV heads, {dtype}")


def test_layers_of_different_kinds_share_one_batch() -> None:
    """Gemma 2 alternates windowed and global layers; a DFlash draft mixes in a bidirectional one. Each layer must
    get its own kind's keys and mask in the same batch, whatever ran before it."""
    case = _case(ForwardMode.EXTEND, [(9, 4), (1, 3)])
    kinds = [
        _layer(case, 0, sliding_window_size=2, logit_cap=1.0),
        _layer(case, 1, logit_cap=1.0),
        _layer(case, 2, sliding_window_size=2, is_causal=False),
    ]
    for layer in (*kinds, *kinds):
        out, expected = _run(case, layer)
        _assert_close(out, expected, f"layer {layer.layer_id} ({', '.join(layer.variant_features)})")


def test_draft_decode_over_branch_rows_with_a_window() -> None:
    """Draft decode with topk > 1: branch rows share their request's prefix slots; positions are indices."""
    case = _case(ForwardMode.EXTEND, [(0, 8)])
    pool = case.runner.kv_pool
    _write(case.runner, case.generator, case.batch.out_cache_loc)
    request = int(case.batch.req_pool_indices[0])
    branches = [case.runner.new_request() for _ in range(3)]
    for row in branches:
        pool.req_to_token[row, :8] = pool.req_to_token[request, :8]
    for step in range(2):
        case.batch = case.runner.prepare_batch(ForwardMode.DECODE, [(row, 8 + step, 1) for row in branches])
        layer = _layer(case, sliding_window_size=3, has_sinks=True)
        out, expected = _run(case, layer, sinks=_sinks(case, layer))
        _assert_close(out, expected, f"draft decode over branch rows, step {step}")


def test_a_non_causal_layer_in_a_tree_batch_is_refused_by_name() -> None:
    case = _case(ForwardMode.TARGET_VERIFY, [(3, 4)], tree=tree_mask((-1, 0, 0, 1)))
    layer = _layer(case, 2, is_causal=False)
    with pytest.raises(ValueError) as refused:
        _run(case, layer)
    message = str(refused.value)
    assert "batched_matmul" in message and "layer 2" in message and "is_causal=False" in message, message
    assert "TARGET_VERIFY" in message and "tree" in message and "without a tree" in message, message


def test_sinks_missing_or_misshapen_are_refused_by_name() -> None:
    case = _case(ForwardMode.DECODE, [(4, 1)])
    layer = _layer(case, 1, has_sinks=True)
    with pytest.raises(ValueError, match=r"batched_matmul: layer 1 has attention sinks.*without sinks="):
        _run(case, layer)
    with pytest.raises(ValueError, match=r"batched_matmul: layer 1 got sinks of shape \(2,\).*shape \(4,\)"):
        _run(case, layer, sinks=torch.zeros(2))
