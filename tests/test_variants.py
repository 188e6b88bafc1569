"""The attention variants (docs/variants.md): the float64 reference against an independent formulation,
``torch_native`` against the reference in every forward mode, and the conformance kit's variant cases against
real installed backends that get a window off by one or declare variants they ignore."""

# ruff: noqa: E402  (the module skips itself, pytest.importorskip, before importing what needs torch)

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch
import torch
from distgen import make_dist
from helpers import GROUP, subprocess_env

from attnhost.backend import AttentionLayer
from attnhost.forward_mode import ForwardMode
from attnhost.hybrid import HybridAttnBackend
from attnhost.runner import ModelRunner
from attnhost.server_args import ServerArgs
from attnhost.testing.cases import SPECULATIVE_TREES
from attnhost.testing.reference import reference_attention, reference_request_attention, tree_mask
from attnhost_builtin import torch_native_variants
from attnhost_builtin.torch_native import TorchNativeAttnBackend

# -- the reference against HF's formulation ------------------------------------------------


def _hf_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    prefix_len: int,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """HF transformers' eager attention as Gemma 2 and gpt-oss write it, for one request: an additive mask from
    HF's ``sliding_window`` (a query sees ``sliding_window`` keys, itself included: ``q_idx - kv_idx <
    sliding_window``), softcapping as ``tanh(w / cap) * cap``, sinks as an extra logit column dropped after the
    softmax. Written separately from the reference, in HF's terms."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qh = q.double().transpose(0, 1)  # [heads, new, dim]
    kh = k.double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    vh = v.double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    weights = torch.matmul(qh, kh.transpose(1, 2)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    q_idx = torch.arange(q.shape[0]).view(-1, 1) + prefix_len
    kv_idx = torch.arange(k.shape[0]).view(1, -1)
    allowed = kv_idx <= q_idx if causal else torch.ones_like(kv_idx - q_idx, dtype=torch.bool)
    if sliding_window is not None:
        allowed = allowed & (kv_idx > q_idx - sliding_window)
    weights = weights + torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        combined = torch.cat([weights, column], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(weights, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 1, 4, 12], ids=lambda w: f"hf-window-{w}")
@pytest.mark.parametrize(
    ("cap", "sinks", "causal"),
    [(None, False, True), (3.0, False, True), (None, True, True), (None, False, False), (2.0, True, False)],
    ids=["plain", "cap", "sinks", "non-causal", "all"],
)
def test_reference_agrees_with_hf_eager_attention(
    window: int | None, cap: float | None, sinks: bool, causal: bool
) -> None:
    """HF's ``sliding_window = W`` is the reference's ``sliding_window_size = W - 1``; cap and sinks as HF's."""
    gen = torch.Generator().manual_seed(1)
    prefix, new, heads, kv_heads, dim = 9, 6, 4, 2, 8
    q = torch.randn(new, heads, dim, generator=gen)
    k = torch.randn(prefix + new, kv_heads, dim, generator=gen)
    v = torch.randn(prefix + new, kv_heads, dim, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    ours = reference_request_attention(
        q,
        k,
        v,
        prefix_len=prefix,
        scaling=0.5,
        sliding_window_size=-1 if window is None else window - 1,
        logit_cap=cap or 0.0,
        sinks=sink,
        causal=causal,
    )
    hf = _hf_eager(
        q, k, v, prefix_len=prefix, scaling=0.5, sliding_window=window, softcap=cap, sinks=sink, causal=causal
    )
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-12)


def _one_hot_values(seq: int, heads: int = 1) -> torch.Tensor:
    """Key ``j``'s value is the unit vector ``e_j``: an output's entries are then the weights themselves."""
    return torch.eye(seq, dtype=torch.float64).unsqueeze(1).expand(seq, heads, seq)


def test_reference_window_w_shows_exactly_w_plus_one_keys() -> None:
    """With zero queries every visible key weighs the same: the weights name the visible keys."""
    seq, w = 10, 3
    q, k, v = torch.zeros(1, 1, seq), torch.randn(seq, 1, seq), _one_hot_values(seq)
    out = reference_request_attention(q, k, v, prefix_len=seq - 1, scaling=1.0, sliding_window_size=w)
    expected = torch.zeros(seq, dtype=torch.float64)
    expected[seq - 1 - w :] = 1 / (w + 1)  # positions 6, 7, 8, 9: the query and the w keys before it
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-15)
    causal_prefill = reference_request_attention(
        torch.zeros(seq, 1, seq), k, v, prefix_len=0, scaling=1.0, sliding_window_size=0
    )
    torch.testing.assert_close(causal_prefill[:, 0], torch.eye(seq, dtype=torch.float64))  # w = 0: itself only
    both_ways = reference_request_attention(
        torch.zeros(4, 1, seq), k, v, prefix_len=seq - 4, scaling=1.0, sliding_window_size=2, causal=False
    )
    # non-causal: the window limits the left side only; query at position 6 sees 4 .. 9
    torch.testing.assert_close(both_ways[0, 0, 4:], torch.full((6,), 1 / 6, dtype=torch.float64))
    assert not both_ways[0, 0, :4].any()


def test_reference_sink_takes_its_share_of_the_mass() -> None:
    """Equal scores over ``n`` keys and a sink ``s``: each key weighs ``1 / (n + e**s)``, the sink adds no value."""
    seq, sink = 5, 1.3
    q, k, v = torch.zeros(1, 2, seq), torch.randn(seq, 1, seq), _one_hot_values(seq)
    sinks = torch.tensor([sink, -50.0])  # head 1's sink is negligible
    out = reference_request_attention(q, k, v, prefix_len=seq - 1, scaling=1.0, sinks=sinks)
    torch.testing.assert_close(out[0, 0], torch.full((seq,), 1 / (seq + math.exp(sink)), dtype=torch.float64))
    torch.testing.assert_close(out[0, 1], torch.full((seq,), 1 / seq, dtype=torch.float64))


def test_reference_soft_cap_bends_scores_by_tanh() -> None:
    """Two keys with scores 4 and 0 under a cap of 2: weights ``softmax(2 tanh(2), 0)``."""
    q = torch.tensor([[[2.0, 0.0]]], dtype=torch.float64)
    k = torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    v = _one_hot_values(2)
    out = reference_request_attention(q, k, v, prefix_len=1, scaling=1.0, logit_cap=2.0)
    high = math.exp(2 * math.tanh(2.0))
    torch.testing.assert_close(out[0, 0], torch.tensor([high, 1.0], dtype=torch.float64) / (high + 1))


def test_reference_tree_positions_are_depths() -> None:
    """In a tree a new token's position is the prefix plus its depth: with ``w = 1`` a depth-2 token sees its
    parent and itself, not its grandparent, and the root's sibling branch never."""
    prefix, parents = 3, (-1, 0, 1, 0)
    block = tree_mask(parents).view(4, 4)
    seq = prefix + 4
    out = reference_request_attention(
        torch.zeros(4, 1, seq),
        torch.randn(seq, 1, seq),
        _one_hot_values(seq),
        prefix_len=prefix,
        scaling=1.0,
        tree=block,
        sliding_window_size=1,
    )
    weights = out[:, 0]
    assert weights[2].nonzero().flatten().tolist() == [prefix + 1, prefix + 2]  # parent (depth 1) and itself
    assert weights[3].nonzero().flatten().tolist() == [prefix, prefix + 3]  # depth 1: the root and itself
    assert weights[0].nonzero().flatten().tolist() == [prefix - 1, prefix]  # the root: the last prefix key


# -- torch_native against the reference ----------------------------------------------------

_MODES_TREE = tree_mask(SPECULATIVE_TREES["topk2-6-wide"], SPECULATIVE_TREES["topk3-8-deep"])


def _steps(causal: bool) -> list[tuple[ForwardMode, list[tuple[int, int, int]], torch.Tensor | None]]:
    """Every forward mode over four requests (by index) and a scattered one (index 4): (mode, batch, tree)."""
    steps = [
        (ForwardMode.EXTEND, [(0, 0, 30), (1, 0, 5), (2, 0, 1), (3, 0, 70)], None),
        (ForwardMode.EXTEND, [(0, 30, 7), (1, 5, 12), (4, 17, 5)], None),
        (ForwardMode.DECODE, [(0, 37, 1), (1, 17, 1), (2, 1, 1), (4, 22, 1)], None),
        (ForwardMode.DECODE, [(3, 70, 1)], None),
        (ForwardMode.DECODE, [(4, 23, 1)], None),
        (ForwardMode.MIXED, [(0, 38, 1), (1, 18, 6), (2, 2, 1), (3, 71, 9)], None),
        (ForwardMode.TARGET_VERIFY, [(0, 39, 4), (4, 24, 4)], None),
        (ForwardMode.DRAFT_EXTEND_V2, [(0, 39, 3), (1, 24, 1), (4, 24, 2)], None),
        (ForwardMode.DRAFT_EXTEND, [(3, 80, 5)], None),
    ]
    if causal:
        steps.append((ForwardMode.TARGET_VERIFY, [(0, 42, 6), (1, 25, 8)], _MODES_TREE))
    return steps


def _runner(dtype: torch.dtype, heads: int, kv_heads: int, *, is_draft: bool = False) -> ModelRunner:
    return ModelRunner(
        ServerArgs(attention_backend="torch_native"),
        is_draft=is_draft,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
        max_requests=16,
        max_context_len=256,
        num_slots=4096,
        dtype=dtype,
    )


def _scattered(runner: ModelRunner, length: int, gen: torch.Generator) -> int:
    pool = runner.kv_pool
    request = runner.new_request()
    slots = pool.alloc_slots(length).flip(0)
    pool.req_to_token[request, :length] = slots
    shape = (length, pool.num_kv_heads, pool.head_dim)
    pool.set_kv(0, slots, torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen))
    return request


def _run_modes(
    layer_kw: dict[str, object],
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    steps: Sequence[tuple[ForwardMode, list[tuple[int, int, int]], torch.Tensor | None]],
    *,
    hybrid: bool = False,
) -> list[tuple[str, float]]:
    """Each step's max abs error against the reference, by mode (through a prefill/decode hybrid if asked)."""
    gen = torch.Generator().manual_seed(3)
    runner = _runner(dtype, heads, kv_heads)
    if hybrid:
        halves = TorchNativeAttnBackend(runner), TorchNativeAttnBackend(runner)
        runner.attn_backend = HybridAttnBackend(*halves, speculative_attention_mode="prefill")
    layer = dataclasses.replace(runner.layers[0], **layer_kw)  # type: ignore[arg-type]
    requests = [runner.new_request() for _ in range(4)]
    requests.append(_scattered(runner, 17, gen))
    errors = []
    for mode, spec, tree in steps:
        batch = runner.prepare_batch(mode, [(requests[i], prefix, new) for i, prefix, new in spec], tree)
        n = batch.num_new_tokens
        q = torch.randn(n, heads, 16, generator=gen).to(dtype)
        k, v = (torch.randn(n, kv_heads, 16, generator=gen).to(dtype) for _ in range(2))
        sinks = torch.randn(heads, generator=gen) * 1.5 + 1.0 if layer.has_sinks else None
        with torch.no_grad(), runner.forward_context() as backend:
            out = backend.forward(q, k, v, layer, batch, sinks=sinks)
        assert out.dtype == dtype and out.shape == q.shape
        error = float((out.double() - reference_attention(q, layer, batch, sinks=sinks)).abs().max())
        errors.append((f"{mode.name} {spec}", error))
    return errors


_VARIANTS = {
    "window-0": {"sliding_window_size": 0},
    "window-6": {"sliding_window_size": 6},
    "window-40": {"sliding_window_size": 40},
    "cap": {"logit_cap": 2.0},
    "sinks": {"has_sinks": True},
    "non-causal": {"is_causal": False},
    "window+cap": {"sliding_window_size": 6, "logit_cap": 2.0},
    "window+sinks": {"sliding_window_size": 6, "has_sinks": True},
    "window+non-causal": {"sliding_window_size": 6, "is_causal": False},
    "all": {"sliding_window_size": 9, "logit_cap": 3.0, "has_sinks": True, "is_causal": False},
}
_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_torch_native_variants_in_every_mode(variant: str, dtype: torch.dtype) -> None:
    layer_kw = _VARIANTS[variant]
    errors = _run_modes(layer_kw, dtype, 8, 2, _steps(causal=layer_kw.get("is_causal", True) is True))
    assert [(what, e) for what, e in errors if not e <= _ATOL[dtype]] == []


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 1)], ids=["mha", "mqa"])
def test_torch_native_variants_in_every_head_layout(heads: int, kv_heads: int) -> None:
    for layer_kw in ({"sliding_window_size": 5, "logit_cap": 2.0, "has_sinks": True}, {"is_causal": False}):
        steps = _steps(causal=layer_kw.get("is_causal", True) is True)
        errors = _run_modes(layer_kw, torch.float32, heads, kv_heads, steps)
        assert [(what, e) for what, e in errors if not e <= 1e-5] == [], layer_kw


def test_a_prefill_decode_hybrid_passes_sinks_on() -> None:
    """Different prefill and decode backends (a HybridAttnBackend) hand ``sinks=`` to whichever serves the mode."""
    layer_kw = {"sliding_window_size": 6, "has_sinks": True}
    errors = _run_modes(layer_kw, torch.float32, 8, 2, _steps(causal=True), hybrid=True)
    assert [(what, e) for what, e in errors if not e <= 1e-5] == []


def test_long_prompts_are_attended_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt whose scores would pass the block budget is cut into query blocks, each reading only the keys it
    may see (the band of a window shared between blocks): same numbers as one block."""
    monkeypatch.setattr(torch_native_variants, "_BLOCK_ELEMENTS", 8 * 16 * 22)  # 16-query blocks at w = 6
    steps = [
        (ForwardMode.EXTEND, [(0, 0, 90), (1, 0, 3)], None),
        (ForwardMode.EXTEND, [(0, 90, 41), (4, 17, 30)], None),
        (ForwardMode.DECODE, [(0, 131, 1), (1, 3, 1)], None),
    ]
    for layer_kw in (*list(_VARIANTS.values())[:-1], {"sliding_window_size": 6, "is_causal": False, "logit_cap": 2.0}):
        errors = _run_modes(layer_kw, torch.float32, 8, 2, steps)
        assert [(what, e) for what, e in errors if not e <= 1e-5] == [], layer_kw
    runner = _runner(torch.float32, 8, 2)
    request = runner.new_request()
    batch = runner.prepare_batch(ForwardMode.EXTEND, [(request, 0, 90)])
    layer = dataclasses.replace(runner.layers[0], sliding_window_size=6)
    q, k = torch.randn(90, 8, 16), torch.randn(90, 2, 16)
    with torch.no_grad(), runner.forward_context() as backend:
        backend.forward(q, k, k, layer, batch)
    plan = backend._plan  # type: ignore[attr-defined]
    recipe = plan.requests[0].variants[(6, True, 8, 4)]
    assert len(recipe.blocks) > 3
    widths = {block.keys.stop - block.keys.start for block in recipe.blocks[1:-1]}
    rows = recipe.blocks[1].rows.stop - recipe.blocks[1].rows.start
    assert widths == {rows + 6}  # an inner block reads its queries' keys and the window before them, no more
    assert len({key for key in plan.variant_masks if key[0] == "band"}) <= 3  # first, inner (shared), last


@pytest.mark.parametrize("shape", ["decode-chunk", "decode-alone", "decode-scattered", "extend"], ids=lambda s: s)
def test_windowed_attention_reads_only_the_window(shape: str) -> None:
    """Every cache row outside the window is NaN: a backend that reads it (even to mask it) gives NaN."""
    runner = _runner(torch.float32, 8, 2)
    gen = torch.Generator().manual_seed(5)
    pool, w = runner.kv_pool, 7
    layer = dataclasses.replace(runner.layers[0], sliding_window_size=w, has_sinks=shape == "decode-chunk")
    requests = (
        [runner.new_request() for _ in range(3)] if shape != "decode-scattered" else [_scattered(runner, 60, gen)]
    )
    lengths = [60, 25, 40][: len(requests)]
    if shape != "decode-scattered":
        filled = runner.prepare_batch(ForwardMode.EXTEND, [(r, 0, n) for r, n in zip(requests, lengths, strict=True)])
        pool.set_kv(0, filled.out_cache_loc, *(torch.randn(sum(lengths), 2, 16, generator=gen) for _ in range(2)))
    if shape == "decode-chunk":
        spec = [(r, n, 1) for r, n in zip(requests, lengths, strict=True)]
    elif shape == "extend":
        spec = [(requests[0], 60, 4), (requests[1], 25, 3)]
    else:
        spec = [(requests[0], 60, 1)]
    batch = runner.prepare_batch(ForwardMode.DECODE if shape != "extend" else ForwardMode.EXTEND, spec)
    n = batch.num_new_tokens
    q, k, v = torch.randn(n, 8, 16, generator=gen), torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16)
    sinks = torch.randn(8, generator=gen) if layer.has_sinks else None
    pool.set_kv(0, batch.out_cache_loc, k, v)
    clean_k, clean_v = pool.k_buffer(0).clone(), pool.v_buffer(0).clone()
    for request, prefix, _ in spec:  # every query of the batch sees positions prefix - w on, no earlier one
        outside = pool.req_to_token[request, : max(0, prefix - w)]
        pool.k_buffer(0)[outside] = float("nan")
        pool.v_buffer(0)[outside] = float("nan")
    with torch.no_grad(), runner.forward_context() as backend:
        out = backend.forward(q, k, v, layer, batch, save_kv_cache=False, sinks=sinks)
    ref = reference_attention(q, layer, batch, k_buffer=clean_k, v_buffer=clean_v, sinks=sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_flat_heads_with_variants() -> None:
    """SGLang's ``[T, heads * dim]`` queries through the variant paths (extend and decode), answered flat."""
    runner = _runner(torch.float32, 8, 2)
    gen = torch.Generator().manual_seed(7)
    layer = dataclasses.replace(runner.layers[0], sliding_window_size=4, logit_cap=2.0, has_sinks=True)
    first, second = runner.new_request(), runner.new_request()
    for mode, spec in (
        (ForwardMode.EXTEND, [(first, 0, 20), (second, 0, 7)]),
        (ForwardMode.DECODE, [(first, 20, 1), (second, 7, 1)]),
        (ForwardMode.EXTEND, [(first, 21, 5)]),
    ):
        batch = runner.prepare_batch(mode, spec)
        n = batch.num_new_tokens
        q, k, sinks = torch.randn(n, 8, 16, generator=gen), torch.randn(n, 2, 16, generator=gen), torch.randn(8)
        with torch.no_grad(), runner.forward_context() as backend:
            out = backend.forward(q.flatten(1), k.flatten(1), k.flatten(1), layer, batch, sinks=sinks)
        assert out.shape == (n, 128)
        ref = reference_attention(q, layer, batch, sinks=sinks)
        torch.testing.assert_close(out.view(n, 8, 16).double(), ref, rtol=0, atol=1e-5)


def _variant_batch(layer_kw: dict[str, object], tree: bool = False) -> tuple[ModelRunner, AttentionLayer, object]:
    runner = _runner(torch.float32, 8, 2)
    request = runner.new_request()
    runner.prepare_batch(ForwardMode.EXTEND, [(request, 0, 5)])
    mode = ForwardMode.TARGET_VERIFY if tree else ForwardMode.EXTEND
    batch = runner.prepare_batch(mode, [(request, 5, 4)], tree_mask(SPECULATIVE_TREES["topk2-4"]) if tree else None)
    return runner, dataclasses.replace(runner.layers[0], **layer_kw), batch  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layer_kw", "sinks", "message"),
    [
        ({"has_sinks": True}, None, "layer 0 has attention sinks (has_sinks=True) but was called without them"),
        ({}, torch.zeros(8), "layer 0 was called with sinks= but does not declare has_sinks=True"),
        ({"has_sinks": True}, torch.zeros(4), "layer 0's sinks have shape (4,), expected (8,)"),
    ],
    ids=["missing", "undeclared", "wrong-shape"],
)
def test_sinks_that_do_not_fit_the_layer_are_refused(
    layer_kw: dict[str, object], sinks: torch.Tensor | None, message: str
) -> None:
    runner, layer, batch = _variant_batch(layer_kw)
    q, k = torch.randn(4, 8, 16), torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match=r"^torch_native: ") as info, runner.forward_context() as backend:
        backend.forward_extend(q, k, k, layer, batch, sinks=sinks)  # type: ignore[call-arg, arg-type]
    assert message in str(info.value)


def test_a_tree_over_a_non_causal_layer_is_refused_naming_the_layer() -> None:
    runner, layer, batch = _variant_batch({"is_causal": False}, tree=True)
    q, k = torch.randn(4, 8, 16), torch.randn(4, 2, 16)
    with pytest.raises(ValueError) as info, runner.forward_context() as backend:
        backend.forward(q, k, k, layer, batch)  # type: ignore[arg-type]
    assert str(info.value).startswith(
        "torch_native: layer 0 is non-causal (is_causal=False), and this TARGET_VERIFY batch carries a "
        "speculative tree (tree_mask)"
    ), info.value


def test_torch_native_declares_every_variant() -> None:
    from attnhost_builtin.torch_native import TorchNativeAttnBackend

    caps = TorchNativeAttnBackend.capabilities
    assert (caps.sliding_window, caps.logit_cap, caps.sinks, caps.non_causal) == (True, True, True, True)
    layer = AttentionLayer(0, 8, 2, 16, sliding_window_size=4095, logit_cap=30.0, has_sinks=True, is_causal=False)
    assert caps.layer_refusal(layer) is None


# -- the kit against real installed backends --------------------------------------------------

_PLUGIN = '''\
"""Hooks only: discovery must stay cheap."""
from attnhost import BackendSpec, hookimpl

BACKENDS = {
    "variants": "Variants", "window_plus_one": "WindowPlusOne", "ignores_variants": "IgnoresVariants",
    "plain_loop": "PlainLoop", "non_causal_trees": "NonCausalTrees",
}


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(name=n, factory=f"attnhost_variants_impl:{c}", requires=("torch",), description=f"test {n}")
        for n, c in BACKENDS.items()
    ]


@hookimpl
def attnhost_draft_attention_backends():
    return list(BACKENDS)
'''

_IMPL = '''\
"""A per-request loop backend in HF's terms (gpt-oss's sink column), with switches for the bugs."""
import torch

from attnhost import AttentionBackend, BackendCapabilities

# float32 only: the kit then runs each case once, which is all these checks need
_ALL = dict(dtypes=("float32",), tree_mask=True, sliding_window=True, logit_cap=True, sinks=True, non_causal=True)


class Variants(AttentionBackend):
    """Honours every variant."""

    capabilities = BackendCapabilities(**_ALL)
    window_shift = 0  # the bug: a window that keeps this many keys more (or fewer)
    honour = True  # False: the bug of declaring variants and ignoring the layer's fields
    refuse_trees = True  # False: the bug of attending a tree over a non-causal layer (as if it were causal)

    def init_forward_metadata(self, forward_batch):
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks)

    def _attend(self, q, k, v, layer, fb, save_kv_cache, sinks):
        pool = fb.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        group = layer.num_heads // layer.num_kv_heads
        window = layer.sliding_window_size if self.honour else -1
        causal = layer.is_causal or not self.honour
        out = torch.zeros(q.shape, dtype=torch.float64)
        cell = 0
        for i in range(fb.batch_size):
            start, new, prefix = fb.extend_start_loc_cpu[i], fb.extend_seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = pool.req_to_token[fb.req_pool_indices[i], : fb.seq_lens_cpu[i]]
            keys = pool.k_buffer(layer.layer_id)[slots].double().repeat_interleave(group, dim=1)
            values = pool.v_buffer(layer.layer_id)[slots].double().repeat_interleave(group, dim=1)
            logits = torch.einsum("thd,shd->hts", q[start : start + new].double(), keys) * layer.scaling
            if self.honour and layer.logit_cap > 0:
                logits = torch.tanh(logits / layer.logit_cap) * layer.logit_cap
            kv_pos = torch.arange(len(slots))
            if fb.tree_mask is not None:
                if not causal and self.refuse_trees:
                    raise ValueError(f"layer {layer.layer_id}: a tree over a non-causal layer")
                block = fb.tree_mask[cell : cell + new * new].view(new, new).cpu()
                cell += new * new
                kv_pos[prefix:] = prefix + block.sum(1) - 1 + (~block.diagonal()).long()
                seen = torch.cat([torch.ones(new, prefix, dtype=torch.bool), block], 1)
            else:
                seen = kv_pos <= prefix + torch.arange(new)[:, None]
                if not causal:
                    seen = torch.ones_like(seen)
            q_pos = kv_pos[prefix:].unsqueeze(1)
            if window >= 0:
                seen = seen & (q_pos - kv_pos < window + 1 + self.window_shift)
            logits = logits.masked_fill(~seen, float("-inf"))
            if self.honour and sinks is not None:
                column = sinks.double().view(-1, 1, 1).expand(-1, new, 1)
                probs = torch.cat([logits, column], -1).softmax(-1)[..., :-1]
            else:
                probs = torch.where(seen.any(-1, keepdim=True), logits.softmax(-1), 0.0)
            out[start : start + new] = torch.einsum("hts,shd->thd", probs, values)
        return out.to(q.dtype)


class WindowPlusOne(Variants):
    """Keeps w + 2 keys: HF's W = w + 1 read as SGLang's w (the off-by-one the kit must catch)."""

    window_shift = 1


class IgnoresVariants(Variants):
    """Declares every variant and attends every layer as plain causal attention."""

    honour = False


class NonCausalTrees(Variants):
    """Attends a speculative tree over a non-causal layer instead of refusing it."""

    refuse_trees = False


class PlainLoop(Variants):
    """Declares no variant (only tree masks)."""

    capabilities = BackendCapabilities(dtypes=("float32",), tree_mask=True)
'''

_KIT_FILE = """\
from attnhost.testing import BackendConformance


class TestVariants(BackendConformance):
    backend_name = "variants"


class TestWindowPlusOne(BackendConformance):
    backend_name = "window_plus_one"


class TestIgnoresVariants(BackendConformance):
    backend_name = "ignores_variants"


class TestPlainLoop(BackendConformance):
    backend_name = "plain_loop"


class TestNonCausalTrees(BackendConformance):
    backend_name = "non_causal_trees"
"""

VARIANT_TESTS = (
    "test_variant_sliding_window",
    "test_variant_sliding_window_at_the_edge",
    "test_variant_sliding_window_draft",
    "test_variant_sliding_window_tree_deeper_than_the_window",
    "test_variant_logit_cap",
    "test_variant_sinks",
    "test_variant_non_causal",
    "test_variant_window_and_cap",
    "test_variant_window_and_sinks",
    "test_variant_window_and_non_causal",
)
WINDOW_TESTS = {name for name in VARIANT_TESTS if "window" in name}


@pytest.fixture(scope="module")
def variant_kit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[str, str]]]:
    """One pytest run of the kit's variant cases against every test backend: ``{class: {test: (status, message)}}``."""
    site = tmp_path_factory.mktemp("variant-site")
    make_dist(
        site,
        "attnhost-variants",
        "0.1",
        {GROUP: {"variants": "attnhost_variants"}},
        modules={"attnhost_variants": _PLUGIN, "attnhost_variants_impl": _IMPL},
    )
    project = tmp_path_factory.mktemp("variant-author")
    (project / "test_kit.py").write_text(_KIT_FILE)
    junit = project / "junit.xml"
    # the kit's variant cases only; of them, only the non-causal one for the backend whose bug only it shows
    select = "test_variant_ and (not NonCausalTrees or test_variant_non_causal)"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", "-k", select],
        capture_output=True,
        text=True,
        cwd=project,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(project / "xdg-cache")}),
        timeout=900,
    )
    assert junit.exists(), proc.stdout + proc.stderr
    results: dict[str, dict[str, tuple[str, str]]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
                message = child.get("message", "").removeprefix("Failed: ")
        results.setdefault(case.get("classname", "").rpartition(".")[2], {})[case.get("name", "")] = (status, message)
    every = dict.fromkeys(("TestVariants", "TestWindowPlusOne", "TestIgnoresVariants", "TestPlainLoop"), VARIANT_TESTS)
    expected = {**every, "TestNonCausalTrees": ("test_variant_non_causal",)}
    assert {cls: set(tests) for cls, tests in results.items()} == {
        cls: set(tests) for cls, tests in expected.items()
    }, proc.stdout[-3000:]
    return results


def _failed(results: dict[str, tuple[str, str]]) -> set[str]:
    return {name for name, (status, _) in results.items() if status in ("failed", "error")}


def test_kit_passes_a_correct_variant_backend(variant_kit: dict[str, dict[str, tuple[str, str]]]) -> None:
    assert {name: status for name, (status, _) in variant_kit["TestVariants"].items()} == dict.fromkeys(
        VARIANT_TESTS, "passed"
    )


def test_kit_catches_a_window_off_by_one(variant_kit: dict[str, dict[str, tuple[str, str]]]) -> None:
    """A backend that keeps ``w + 2`` keys (HF's ``W`` read as SGLang's ``w``) fails every window case, each
    message naming the case; at the edge it passes ``seq_len == w + 1`` and fails ``w + 2``."""
    results = variant_kit["TestWindowPlusOne"]
    assert _failed(results) == WINDOW_TESTS  # soft-cap, sinks and non-causal alone are right
    edge = results["test_variant_sliding_window_at_the_edge"][1]
    assert edge.startswith(
        "sliding window at its edge (float32), sliding_window_size=9 and 0: decode at the window's edge "
        "(seq_len = w + 1 and w + 2): max abs error"
    ), edge
    window = results["test_variant_sliding_window"][1]
    assert window.startswith("sliding window (float32), sliding_window_size=7 and 40: "), window
    assert "exceeds 1e-05 (float32, 8 heads / 2 KV heads, layer " in window, window


def test_kit_reports_a_backend_that_declares_variants_and_ignores_them(
    variant_kit: dict[str, dict[str, tuple[str, str]]],
) -> None:
    results = variant_kit["TestIgnoresVariants"]
    assert _failed(results) == set(VARIANT_TESTS)
    for name, case in (
        ("test_variant_logit_cap", "logit soft-cap (float32), logit_cap=3 and 5: prefill: max abs error"),
        ("test_variant_sinks", "attention sinks (float32), has_sinks=True: prefill: max abs error"),
        ("test_variant_non_causal", "non-causal (float32), is_causal=False: prefill: max abs error"),
        ("test_variant_window_and_sinks", "window and sinks (float32), sliding_window_size=6, has_sinks=True: "),
    ):
        assert results[name][1].startswith(case), results[name][1]


def test_kit_skips_what_a_backend_does_not_declare_naming_the_flag(
    variant_kit: dict[str, dict[str, tuple[str, str]]],
) -> None:
    results = variant_kit["TestPlainLoop"]
    assert {status for status, _ in results.values()} == {"skipped"}
    first_flag = {
        "test_variant_logit_cap": "logit_cap",
        "test_variant_sinks": "sinks",
        "test_variant_non_causal": "non_causal",
    }
    for name, (_, message) in results.items():
        flag = first_flag.get(name, "sliding_window")
        assert f"backend 'plain_loop' does not declare {flag} (capabilities.{flag} = False)" in message, message


def test_kit_fails_a_backend_that_attends_a_tree_over_a_non_causal_layer(
    variant_kit: dict[str, dict[str, tuple[str, str]]],
) -> None:
    status, message = variant_kit["TestNonCausalTrees"]["test_variant_non_causal"]
    assert status == "failed"
    assert message.startswith(
        "non-causal tree: backend 'non_causal_trees' attended a speculative tree (TARGET_VERIFY with tree_mask) over "
        "a non-causal layer (layer 0, is_causal=False)"
    ), message
