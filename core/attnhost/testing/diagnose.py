"""Why an attention output is wrong: the usual mistakes, each recomputed and held against the output.

A failure that says only "max abs error 2.8e+00" leaves the author to guess.
Most wrong kernels make one of a few mistakes (the softmax scale missing or
doubled, query heads mapped to the wrong KV head, the causal mask off by one,
the cached prefix ignored, another layer's cache read, a variant ignored), and
each mistake is itself an attention that can be computed exactly. So the
reference is recomputed with each mistake in turn; the one the output agrees
with is named, with the question that leads to the fix. The recomputations go
through :func:`attnhost.testing.reference.reference_request_attention` with
changed arguments (a scale, a re-ordered KV head layout, a shifted mask,
fewer keys), so a diagnosis never rests on a second, differently wrong
attention.

Engine kits call :func:`diagnose` with their own batches cut into
:class:`RequestView` s; the conformance kit calls :func:`diagnose_batch` with
attnhost's :class:`~attnhost.forward_batch.ForwardBatch`. Runs only once an
output has already failed, so its cost never touches a passing run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnhost.backend import AttentionLayer
from attnhost.forward_batch import ForwardBatch
from attnhost.testing.reference import cache_values, reference_request_attention, tree_blocks

__all__ = ["MISTAKES", "LayerFacts", "Mistake", "Reference", "RequestView", "diagnose", "diagnose_batch"]

#: How much closer than the correct reference a mistaken one must be, when not within tolerance, to be named.
CLOSER = 20.0


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What the reference needs of a layer (SGLang's ``RadixAttention`` names)."""

    num_heads: int
    num_kv_heads: int
    scaling: float
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    causal: bool = True
    sinks: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: AttentionLayer, sinks: torch.Tensor | None = None) -> LayerFacts:
        return cls(
            layer.num_heads,
            layer.num_kv_heads,
            layer.scaling,
            layer.sliding_window_size,
            layer.logit_cap,
            layer.is_causal,
            sinks,
        )


@dataclasses.dataclass(frozen=True)
class RequestView:
    """One request as the reference reads it: queries ``[new, heads, dim]``, its keys and values
    ``[prefix + new, kv_heads, dim]`` in position order, its tree block (``None``: causal), and the same slots'
    keys and values in the model's other layers (``(layer_id, k, v)``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    prefix_len: int
    tree: torch.Tensor | None = None
    other_layers: tuple[tuple[int, torch.Tensor, torch.Tensor], ...] = ()
    misreadings: tuple[tuple[str, str, torch.Tensor, torch.Tensor], ...] = ()
    """Keys and values as a usual mistake reads the cache, ``(matches, question, k, v)``: an FP8 cache without
    its scales, pages read wrongly (:func:`diagnose_batch` builds them)."""


@dataclasses.dataclass(frozen=True)
class Reference:
    """The correct reference's arguments for one request; calling it with changes computes a mistaken one."""

    prefix_len: int
    scaling: float
    tree: torch.Tensor | None
    sliding_window_size: int
    logit_cap: float
    sinks: torch.Tensor | None
    causal: bool

    @classmethod
    def of(cls, request: RequestView, facts: LayerFacts) -> Reference:
        return cls(
            request.prefix_len,
            facts.scaling,
            request.tree,
            facts.sliding_window_size,
            facts.logit_cap,
            facts.sinks,
            facts.causal,
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **changes: Any) -> torch.Tensor:
        args = dataclasses.replace(self, **changes)
        return reference_request_attention(
            q,
            k,
            v,
            prefix_len=args.prefix_len,
            scaling=args.scaling,
            tree=args.tree,
            sliding_window_size=args.sliding_window_size,
            logit_cap=args.logit_cap,
            sinks=args.sinks,
            causal=args.causal,
        )


#: ``recompute(request, facts, reference)``: the mistaken output of one request, or ``None`` where the mistake
#: would change nothing for that request.
Recompute = Callable[[RequestView, LayerFacts, Reference], torch.Tensor | None]


@dataclasses.dataclass(frozen=True)
class Mistake:
    """One usual mistake: what the output then matches, the question that leads to the fix, and how to compute it."""

    name: str
    matches: str
    question: str
    recompute: Recompute


def _scaled(factor: Callable[[float], float]) -> Recompute:
    def recompute(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
        return ref(request.q, request.k, request.v, scaling=factor(facts.scaling))

    return recompute


def _modulo_heads(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
    """Query head ``h`` reads KV head ``h % num_kv_heads`` (``repeat`` where ``repeat_interleave`` belongs)."""
    heads, kv_heads = facts.num_heads, facts.num_kv_heads
    if kv_heads in (1, heads):
        return None  # both mappings agree
    wrong = torch.arange(heads) % kv_heads
    return ref(request.q, request.k[:, wrong], request.v[:, wrong])


def _causal_tree(offset: int) -> Recompute:
    """A causal mask shifted by ``offset`` within the new tokens (``-1``: a token misses itself, ``+1``: it sees
    the next), written as a tree block so the prefix stays visible."""

    def recompute(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
        new = request.q.shape[0]
        if not facts.causal or request.tree is not None or (offset > 0 and new < 2):
            return None
        return ref(request.q, request.k, request.v, tree=torch.ones(new, new, dtype=torch.bool).tril(offset))

    return recompute


def _without_prefix(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
    """The cached prefix ignored: the new tokens attend over themselves only."""
    prefix = request.prefix_len
    if prefix == 0:
        return None
    return ref(request.q, request.k[prefix:], request.v[prefix:], prefix_len=0)


def _unshifted_mask(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
    """The causal mask not shifted by the prefix: new token ``i`` sees keys ``0..i``, the first keys of the cache."""
    new, prefix = request.q.shape[0], request.prefix_len
    if prefix == 0 or not facts.causal or request.tree is not None:
        return None
    return ref(request.q, request.k[:new], request.v[:new], prefix_len=0)


def _tree_ignored(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
    if request.tree is None:
        return None
    return ref(request.q, request.k, request.v, tree=None)


def _window_shift(delta: int) -> Recompute:
    def recompute(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
        window = facts.sliding_window_size
        if window < 0 or window + delta < 0:
            return None
        return ref(request.q, request.k, request.v, sliding_window_size=window + delta)

    return recompute


def _capped(scaling: Callable[[LayerFacts], float], cap: Callable[[LayerFacts], float]) -> Recompute:
    """A soft-cap written wrong, recomputed through the reference's own cap: ``cap * tanh(score)`` is the
    reference with the scale times the cap, ``scaling * cap * tanh(q·k / cap)`` the reference with the cap times
    the scale."""

    def recompute(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
        if facts.logit_cap <= 0:
            return None
        return ref(request.q, request.k, request.v, scaling=scaling(facts), logit_cap=cap(facts))

    return recompute


def _variant_off(key: str, value: object, applies: Callable[[LayerFacts], bool]) -> Recompute:
    def recompute(request: RequestView, facts: LayerFacts, ref: Reference) -> torch.Tensor | None:
        if not applies(facts):
            return None
        return ref(request.q, request.k, request.v, **{key: value})

    return recompute


MISTAKES: tuple[Mistake, ...] = (
    Mistake(
        "no scale",
        "attention without the softmax scale",
        "is `layer.scaling` applied to q·k?",
        _scaled(lambda s: 1.0),
    ),
    Mistake(
        "scale doubled",
        "attention with the softmax scale doubled",
        "is `layer.scaling` multiplied by 2 somewhere?",
        _scaled(lambda s: 2.0 * s),
    ),
    Mistake(
        "scale applied twice",
        "attention with the softmax scale applied twice (scaling squared, e.g. 1/head_dim for 1/sqrt(head_dim))",
        "is `layer.scaling` applied both to q and to the scores, or is it 1/head_dim?",
        _scaled(lambda s: s * s),
    ),
    Mistake(
        "kv head modulo",
        "attention with query head h reading KV head h % num_kv_heads",
        "consecutive query heads share a KV head, so head h reads KV head h // (num_heads // num_kv_heads) "
        "(repeat_interleave, not repeat)",
        _modulo_heads,
    ),
    Mistake(
        "mask misses itself",
        "attention with the causal mask off by one (a token does not see its own key)",
        "new token i sees keys 0 .. prefix_len + i, itself included: is the mask `<` where `<=` belongs?",
        _causal_tree(-1),
    ),
    Mistake(
        "mask sees the next",
        "attention with the causal mask off by one (a token also sees the next token's key)",
        "new token i sees keys 0 .. prefix_len + i, not prefix_len + i + 1",
        _causal_tree(1),
    ),
    Mistake(
        "prefix ignored",
        "attention over the new tokens only, the cached prefix ignored",
        "does it read every key of the request through kv_pool.req_to_token[req, :seq_len], prefix included?",
        _without_prefix,
    ),
    Mistake(
        "mask not shifted by the prefix",
        "attention whose causal mask is not shifted by the cached prefix (new token i sees keys 0 .. i)",
        "new token i sits at position prefix_len + i: add the prefix length to the mask's row index",
        _unshifted_mask,
    ),
    Mistake(
        "tree ignored",
        "causal attention over the draft tokens, the speculative tree ignored",
        "is forward_batch.tree_mask applied (a draft token sees the prefix and its ancestors only)?",
        _tree_ignored,
    ),
    Mistake(
        "window one wider",
        "attention with a sliding window one key wider",
        "sliding_window_size is SGLang's window_left: a query at p sees keys p - w .. p (HF's sliding_window is w + 1)",
        _window_shift(1),
    ),
    Mistake(
        "window one narrower",
        "attention with a sliding window one key narrower",
        "sliding_window_size is SGLang's window_left: a query at p sees keys p - w .. p, w + 1 keys in all",
        _window_shift(-1),
    ),
    Mistake(
        "window ignored",
        "attention without the sliding window",
        "is `layer.sliding_window_size` applied?",
        _variant_off("sliding_window_size", -1, lambda f: f.sliding_window_size >= 0),
    ),
    Mistake(
        "cap ignored",
        "attention without the logit soft-cap",
        "is `layer.logit_cap` applied (cap * tanh(score / cap))?",
        _variant_off("logit_cap", 0.0, lambda f: f.logit_cap > 0),
    ),
    Mistake(
        "cap without the division",
        "attention soft-capped as cap * tanh(score), the division by the cap inside tanh left out",
        "the soft-cap is `layer.logit_cap * tanh(score / layer.logit_cap)`: is the score divided by the cap?",
        _capped(scaling=lambda f: f.scaling * f.logit_cap, cap=lambda f: f.logit_cap),
    ),
    Mistake(
        "cap before the scale",
        "attention soft-capped before the softmax scale (cap * tanh(q·k / cap) * scaling)",
        "scale q·k by `layer.scaling` first, then cap the score: cap * tanh(scaling * q·k / cap)",
        _capped(scaling=lambda f: f.scaling, cap=lambda f: f.scaling * f.logit_cap),
    ),
    Mistake(
        "sinks ignored",
        "attention without the sinks",
        "is the `sinks=` tensor added to each head's softmax denominator?",
        _variant_off("sinks", None, lambda f: f.sinks is not None),
    ),
    Mistake(
        "causal on a non-causal layer",
        "causal attention on a non-causal layer",
        "`layer.is_causal` is False: a request's new tokens see each other both ways",
        _variant_off("causal", True, lambda f: not f.causal),
    ),
)


def diagnose(
    got: torch.Tensor, requests: Sequence[RequestView], facts: LayerFacts, atol: float, *, layer_id: int = 0
) -> str | None:
    """The sentence naming the mistake ``got`` (``[tokens, heads, dim]``, the requests' new tokens in order)
    matches, or ``None`` when it matches none of them.

    A mistake matches when the output is within ``atol`` of it, or :data:`CLOSER` times closer to it than to the
    correct reference; of several, the closest, and every other one as close (two mistakes that give the same
    output on this batch are both named: the batch cannot tell them apart). A stray constant factor on the output
    (``out * 1.01``) is named when no mistake matches.
    """
    got64 = got.detach().to("cpu", torch.float64).reshape(-1, facts.num_heads, got.shape[-1])
    references = [Reference.of(request, facts) for request in requests]
    correct_parts = [ref(r.q, r.k, r.v) for r, ref in zip(requests, references, strict=True)]
    correct = _cat(correct_parts)
    if got64.shape != correct.shape:
        return None
    error = _max_abs(got64 - correct)
    if not math.isfinite(error):
        return None  # a non-finite output or reference: no mistake recomputed here explains it
    candidates: list[tuple[float, str, str]] = []

    def consider(parts: Sequence[torch.Tensor | None], matches: str, question: str) -> None:
        """A mistake's distance from the output, unless on this batch it gives the correct output anyway (a
        request it does not change keeps its correct output)."""
        mistaken = _cat([c if p is None else p for c, p in zip(correct_parts, parts, strict=True)])
        if _max_abs(mistaken - correct) > 0.0:
            candidates.append((_max_abs(got64 - mistaken), matches, question))

    for mistake in MISTAKES:
        consider(
            [mistake.recompute(r, facts, ref) for r, ref in zip(requests, references, strict=True)],
            mistake.matches,
            mistake.question,
        )
    for other in sorted({layer for r in requests for layer, _, _ in r.other_layers}):
        consider(
            [_read_other_layer(r, other, ref) for r, ref in zip(requests, references, strict=True)],
            f"attention over layer {other}'s keys and values",
            f"does layer {layer_id} read the cache with layer.layer_id, not layer {other}?",
        )
    readings = dict.fromkeys((matches, question) for r in requests for matches, question, _, _ in r.misreadings)
    for matches, question in readings:
        consider([_misread(r, matches, ref) for r, ref in zip(requests, references, strict=True)], matches, question)
    matched = [candidate for candidate in candidates if candidate[0] <= atol or candidate[0] * CLOSER <= error]
    if matched:
        err = min(matched)[0]
        tied = sorted(c for c in matched if c[0] <= err * (1 + 1e-6) + 1e-12)
        matches = " or ".join(dict.fromkeys(m for _, m, _ in tied))
        questions = " Or: ".join(dict.fromkeys(q for _, _, q in tied))
        return f"the output matches {matches} (max abs error {err:.1e} against it): {questions}"
    return _constant_factor(got64, correct, atol)


def diagnose_batch(
    out: torch.Tensor,
    q: torch.Tensor,
    layer: AttentionLayer,
    forward_batch: ForwardBatch,
    atol: float,
    *,
    k_buffer: torch.Tensor | None = None,
    v_buffer: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> str | None:
    """:func:`diagnose` for one layer's output on attnhost's batch; K/V as
    :func:`~attnhost.testing.reference.reference_attention` reads them (``k_buffer``/``v_buffer`` for this layer,
    the pool for the model's other layers)."""
    pool = forward_batch.kv_pool
    k_buf = pool.k_buffer(layer.layer_id) if k_buffer is None else k_buffer
    v_buf = pool.v_buffer(layer.layer_id) if v_buffer is None else v_buffer
    others = [i for i in range(getattr(pool, "num_layers", 0)) if i != layer.layer_id]
    q = q.reshape(-1, layer.num_heads, layer.head_dim)
    trees = tree_blocks(forward_batch)
    requests = []
    for i in range(forward_batch.batch_size):
        start, extend = forward_batch.extend_start_loc_cpu[i], forward_batch.extend_seq_lens_cpu[i]
        req = int(forward_batch.req_pool_indices[i])
        slots = pool.req_to_token[req, : forward_batch.seq_lens_cpu[i]].to(k_buf.device)
        requests.append(
            RequestView(
                q[start : start + extend].to("cpu"),
                cache_values(k_buf[slots].to("cpu"), layer.k_scale),
                cache_values(v_buf[slots].to("cpu"), layer.v_scale),
                forward_batch.prefix_lens_cpu[i],
                None if trees is None else trees[i],
                tuple(
                    (
                        other,
                        cache_values(pool.k_buffer(other)[slots].to("cpu"), layer.k_scale),
                        cache_values(pool.v_buffer(other)[slots].to("cpu"), layer.v_scale),
                    )
                    for other in others
                ),
                _misreadings(pool, layer, k_buf, v_buf, slots),
            )
        )
    return diagnose(out, requests, LayerFacts.of(layer, sinks), atol, layer_id=layer.layer_id)


def _misread(request: RequestView, matches: str, ref: Reference) -> torch.Tensor | None:
    for name, _, k, v in request.misreadings:
        if name == matches:
            return ref(request.q, k, v)
    return None


def _misreadings(
    pool: Any, layer: AttentionLayer, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor
) -> tuple[tuple[str, str, torch.Tensor, torch.Tensor], ...]:
    """One request's keys and values as the cache-format mistakes read them (``slots``: its true slots)."""
    found = []
    k_stored, v_stored = k_buf[slots].to("cpu"), v_buf[slots].to("cpu")
    k_values, v_values = cache_values(k_stored, layer.k_scale), cache_values(v_stored, layer.v_scale)
    if k_stored.element_size() == 1 and (layer.k_scale != 1.0 or layer.v_scale != 1.0):
        k_raw, v_raw = k_stored.to(torch.float64), v_stored.to(torch.float64)
        fix = "an FP8 cache holds x / scale: read stored.to(float32) * layer.k_scale (values: * layer.v_scale)"
        found += [
            ("attention over the FP8 cache's stored values, k_scale and v_scale not applied", fix, k_raw, v_raw),
            ("attention over the FP8 cache with k_scale not applied to the keys", fix, k_raw, v_values),
            ("attention over the FP8 cache with v_scale not applied to the values", fix, k_values, v_raw),
        ]
    size = getattr(pool, "page_size", 1)
    if size > 1:
        positions = torch.arange(len(slots), device=slots.device)
        pages = slots[positions // size * size] // size  # the request's page table, entry by position
        as_slots = (pages + positions % size).clamp(max=len(k_buf) - 1)
        run = (slots[0] + positions).clamp(max=len(k_buf) - 1)
        for matches, question, wrong in (
            (
                "attention over keys read at page_table[i, p // page_size] + p % page_size (a page number used "
                "as a slot number)",
                "token p of a request sits at slot page_table[i, p // page_size] * page_size + p % page_size: "
                "multiply the page number by kv_pool.page_size",
                as_slots,
            ),
            (
                "attention over keys read as one run of slots from the request's first one (pages read as if "
                "contiguous)",
                "a request's pages need not be adjacent: read each page through forward_batch.page_table or every "
                "slot through req_to_token",
                run,
            ),
        ):
            found.append(
                (
                    matches,
                    question,
                    cache_values(k_buf[wrong].to("cpu"), layer.k_scale),
                    cache_values(v_buf[wrong].to("cpu"), layer.v_scale),
                )
            )
    return tuple(found)


def _read_other_layer(request: RequestView, other: int, ref: Reference) -> torch.Tensor | None:
    for layer, k, v in request.other_layers:
        if layer == other:
            return ref(request.q, k, v)
    return None


def _constant_factor(got: torch.Tensor, correct: torch.Tensor, atol: float) -> str | None:
    """``got == c * correct`` for one constant ``c != 1`` (a stray factor on the output), within tolerance."""
    norm = float((correct * correct).sum())
    if norm == 0.0:
        return None
    factor = float((got * correct).sum()) / norm
    residual = _max_abs(got - factor * correct)
    if not residual <= atol or abs(factor - 1.0) < 1e-6:
        return None
    return (
        f"the output is {factor:.4g} times the correct one (max abs error {residual:.1e} against that): is a factor "
        "applied after the softmax, to the output or to the values?"
    )


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(parts)) if parts else torch.zeros(0)


def _max_abs(diff: torch.Tensor) -> float:
    return float(diff.abs().max()) if diff.numel() else 0.0
