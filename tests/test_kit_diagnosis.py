"""The conformance kit names the usual mistake behind a wrong output, not only its size.

Each mistake is a real installed plugin (a distribution written by
``distgen``) whose backend makes exactly that mistake, run through
``pytest --attnhost-backend NAME`` in a fresh interpreter as an author would;
its failure message must name the mistake and the question that leads to the
fix. A correct backend in the same run passes, and a backend that is wrong in
a way none of the mistakes explain gets no diagnosis (a wrong one would send
the author the wrong way).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch
from distgen import make_dist  # noqa: E402
from helpers import GROUP, kit_outcomes  # noqa: E402

_PLUGIN = '''\
"""Hooks only: one backend per usual mistake."""
from attnhost import BackendSpec, hookimpl

MISTAKES = {
    "right": "Right", "no_scale": "NoScale", "scale_doubled": "ScaleDoubled", "scale_squared": "ScaleSquared",
    "modulo_heads": "ModuloHeads", "misses_itself": "MissesItself", "sees_the_next": "SeesTheNext",
    "prefix_ignored": "PrefixIgnored", "unshifted_mask": "UnshiftedMask", "reads_layer_zero": "ReadsLayerZero",
    "one_percent_off": "OnePercentOff", "noisy": "Noisy",
}


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(name=n, factory=f"attnhost_mistakes.impl:{c}", requires=("torch",), description=f"mistake {n}")
        for n, c in MISTAKES.items()
    ]
'''

_IMPL = '''\
"""A plain per-request backend; each subclass makes one of the usual mistakes."""
import torch

from attnhost import AttentionBackend


class Right(AttentionBackend):
    """Correct: the kit passes it."""

    def init_forward_metadata(self, forward_batch):
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def scale(self, layer):
        return layer.scaling

    def kv_heads(self, layer):
        return torch.arange(layer.num_heads) // (layer.num_heads // layer.num_kv_heads)

    def visible(self, prefix, new, seq):
        return torch.arange(seq) <= prefix + torch.arange(new)[:, None]

    def first_key(self, prefix):
        return 0

    def read_layer(self, layer):
        return layer.layer_id

    def _attend(self, q, k, v, layer, fb, save_kv_cache):
        pool = fb.kv_pool
        if save_kv_cache:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        heads = self.kv_heads(layer)
        out = torch.empty_like(q)
        for i in range(fb.batch_size):
            start, new, prefix = fb.extend_start_loc_cpu[i], fb.extend_seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            first = self.first_key(prefix)
            slots = pool.req_to_token[fb.req_pool_indices[i], first : fb.seq_lens_cpu[i]]
            keys = pool.k_buffer(self.read_layer(layer))[slots].double()[:, heads]
            values = pool.v_buffer(self.read_layer(layer))[slots].double()[:, heads]
            scores = torch.einsum("thd,shd->hts", q[start : start + new].double(), keys) * self.scale(layer)
            visible = self.visible(prefix - first, new, len(slots))
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
            out[start : start + new] = self.finish(torch.einsum("hts,shd->thd", weights, values)).to(q.dtype)
        return out

    def finish(self, out):
        return out


class NoScale(Right):
    def scale(self, layer):
        return 1.0


class ScaleDoubled(Right):
    def scale(self, layer):
        return layer.scaling * 2


class ScaleSquared(Right):
    def scale(self, layer):
        return 1.0 / layer.head_dim


class ModuloHeads(Right):
    def kv_heads(self, layer):
        return torch.arange(layer.num_heads) % layer.num_kv_heads


class MissesItself(Right):
    def visible(self, prefix, new, seq):
        return torch.arange(seq) < prefix + torch.arange(new)[:, None]


class SeesTheNext(Right):
    def visible(self, prefix, new, seq):
        return torch.arange(seq) <= prefix + torch.arange(new)[:, None] + 1


class PrefixIgnored(Right):
    def first_key(self, prefix):
        return prefix


class UnshiftedMask(Right):
    def visible(self, prefix, new, seq):
        return torch.arange(seq) <= torch.arange(new)[:, None]


class ReadsLayerZero(Right):
    def read_layer(self, layer):
        return 0


class OnePercentOff(Right):
    def finish(self, out):
        return out * 1.01


class Noisy(Right):
    def finish(self, out):
        return out + 1e-3 * torch.sin(torch.arange(out.numel(), dtype=out.dtype) * 7.0).view_as(out)
'''

#: backend: the kit test that first meets its mistake, and what its failure message must say.
EXPECTED = {
    "no_scale": ("test_extend_without_prefix", "the output matches attention without the softmax scale (max abs error"),
    "scale_doubled": ("test_extend_without_prefix", "the output matches attention with the softmax scale doubled"),
    "scale_squared": (
        "test_extend_without_prefix",
        "the output matches attention with the softmax scale applied twice",
    ),
    "modulo_heads": (
        "test_extend_without_prefix",
        "the output matches attention with query head h reading KV head h % num_kv_heads",
    ),
    "misses_itself": (
        "test_extend_without_prefix",
        "the output matches attention with the causal mask off by one (a token does not see its own key)",
    ),
    "sees_the_next": (
        "test_extend_without_prefix",
        "the output matches attention with the causal mask off by one (a token also sees the next token's key)",
    ),
    "prefix_ignored": (
        "test_extend_with_cached_prefix",
        "the output matches attention over the new tokens only, the cached prefix ignored",
    ),
    "unshifted_mask": (
        "test_extend_with_cached_prefix",
        "the output matches attention whose causal mask is not shifted by the cached prefix",
    ),
    "reads_layer_zero": ("test_extend_without_prefix", "the output matches attention over layer 0's keys and values"),
    "one_percent_off": ("test_extend_without_prefix", "the output is 1.01 times the correct one"),
}


@pytest.fixture(scope="module")
def kit_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One run of the kit's two extend tests against every backend: ``{node id: failure text}`` ("" if passed)."""
    site = tmp_path_factory.mktemp("mistakes-site")
    make_dist(
        site,
        "attnhost-mistakes",
        "0.1",
        {GROUP: {"mistakes": "attnhost_mistakes"}},
        modules={"attnhost_mistakes": _PLUGIN, "attnhost_mistakes.impl": _IMPL},
    )
    cwd = tmp_path_factory.mktemp("author")
    names = ",".join(["right", "noisy", *EXPECTED])
    tests = "test_extend_without_prefix or test_extend_with_cached_prefix"
    outcome = kit_outcomes(site, cwd, names.split(","), tests)
    assert len(outcome) == 2 * (2 + len(EXPECTED)), sorted(outcome)
    return outcome


def test_a_correct_backend_passes_and_gets_no_diagnosis(kit_run: dict[str, str]) -> None:
    assert kit_run["test_extend_without_prefix[right]"] == ""
    assert kit_run["test_extend_with_cached_prefix[right]"] == ""


@pytest.mark.parametrize("backend", sorted(EXPECTED))
def test_the_failure_names_the_mistake(kit_run: dict[str, str], backend: str) -> None:
    test, sentence = EXPECTED[backend]
    message = kit_run[f"{test}[{backend}]"]
    assert re.search(r"max abs error \S+ exceeds 1e-05 \(float32, ", message), message
    assert sentence in message, message
    # one mistake named, never a list the author must sort out, and the question that leads to the fix
    assert re.search(r"\(max abs error \S+ against (it|that)\): \S", message), message
    assert message.count("the output matches") + message.count("the output is ") == 1, message


def test_an_error_none_of_the_mistakes_explains_gets_no_diagnosis(kit_run: dict[str, str]) -> None:
    message = kit_run["test_extend_without_prefix[noisy]"]
    assert "max abs error" in message and "exceeds 1e-05" in message, message
    assert "the output matches" not in message and "the output is " not in message, message


# -- the variants' mistakes, in-process: each wrong output computed by torch's SDPA, a path diagnose never takes --


def _sdpa(q: Any, k: Any, v: Any, visible: Any) -> Any:
    """``[new, heads, dim]`` attention of ``q`` over ``k``/``v`` (``[seq, heads, dim]``) where ``visible``."""
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1), attn_mask=visible
    )
    return out.transpose(0, 1)


def _layer(**variant: Any) -> tuple[Any, Any, Any, int, Any]:
    """Four heads over two KV heads, a prefix of 6 and 5 new tokens; the facts and the visible mask of a plain
    causal layer."""
    import torch

    from attnhost.testing.diagnose import LayerFacts

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=generator, dtype=torch.float64)
    kv = torch.randn(2, 11, 2, 16, generator=generator, dtype=torch.float64)
    causal = torch.arange(11) <= 6 + torch.arange(5)[:, None]
    return q, kv, LayerFacts(4, 2, 0.25, **variant), 6, causal


@pytest.mark.parametrize(
    ("variant", "mistake", "named"),
    [
        ({"sliding_window_size": 3}, "window one wider", "attention with a sliding window one key wider"),
        ({"sliding_window_size": 3}, "window one narrower", "attention with a sliding window one key narrower"),
        ({"sliding_window_size": 3}, "window ignored", "attention without the sliding window"),
        ({"logit_cap": 0.5}, "cap ignored", "attention without the logit soft-cap"),
        ({"causal": False}, "causal", "causal attention on a non-causal layer"),
        ({}, "tree ignored", "causal attention over the draft tokens, the speculative tree ignored"),
    ],
)
def test_a_variant_mistake_is_named(variant: dict[str, Any], mistake: str, named: str) -> None:
    import torch

    from attnhost.testing.diagnose import RequestView, diagnose

    q, (k, v), facts, prefix, causal = _layer(**variant)
    full_k, full_v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    positions = torch.arange(11)
    tree = None
    if mistake.startswith("window"):
        width = {"window one wider": 4, "window one narrower": 2, "window ignored": 11}[mistake]
        wrong = _sdpa(q, full_k, full_v, causal & (6 + torch.arange(5)[:, None] - positions <= width))
    elif mistake in ("cap ignored", "causal"):
        wrong = _sdpa(q, full_k, full_v, causal)
    else:  # a chain-shaped answer to a tree: token 2's parent is the root, not token 1
        from attnhost.testing.reference import tree_mask

        tree = tree_mask((-1, 0, 0, 1, 2)).view(5, 5)
        wrong = _sdpa(q, full_k, full_v, causal)
    # SDPA scales by its default 1/sqrt(16): the layer's scaling of 0.25
    message = diagnose(wrong, [RequestView(q, k, v, prefix, tree)], facts, 1e-9)
    assert message is not None and message.startswith(f"the output matches {named} (max abs error"), message


def _capped(q: Any, k: Any, v: Any, visible: Any, transform: Any) -> Any:
    """``[new, heads, dim]`` attention whose scores (``q·k``, unscaled) go through ``transform``, by hand."""
    import torch

    scores = transform(torch.einsum("qhd,khd->hqk", q.double(), k.double()))
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v.double())


CAP_MISTAKES = {
    "without the division": (
        lambda s, cap: cap * (s * 0.25).tanh(),
        "attention soft-capped as cap * tanh(score), the division by the cap inside tanh left out",
    ),
    "before the scale": (
        lambda s, cap: cap * (s / cap).tanh() * 0.25,
        "attention soft-capped before the softmax scale",
    ),
}


@pytest.mark.parametrize("cap", [3.0, 5.0])
@pytest.mark.parametrize("mistake", sorted(CAP_MISTAKES))
def test_a_soft_cap_written_wrong_is_named_at_the_kits_caps(mistake: str, cap: float) -> None:
    """The kit's caps (``VariantConformance.variant_caps``) keep each wrong cap apart from every other mistake."""
    from attnhost.testing.diagnose import LayerFacts, RequestView, diagnose
    from attnhost.testing.variant_conformance import VariantConformance

    assert cap in VariantConformance.variant_caps
    q, (k, v), _, prefix, causal = _layer()
    transform, named = CAP_MISTAKES[mistake]
    wrong = _capped(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), causal, lambda s: transform(s, cap)
    )
    facts = LayerFacts(4, 2, 0.25, logit_cap=cap)
    message = diagnose(wrong, [RequestView(q, k, v, prefix)], facts, 1e-9)
    assert message is not None and message.startswith(f"the output matches {named}"), message
    assert " or " not in message.split("(max abs error")[0], message


def test_two_mistakes_a_batch_cannot_tell_apart_are_both_named() -> None:
    """At a cap of 2, ``cap * tanh(score)`` is exactly a doubled scale under the cap: both are named."""
    from attnhost.testing.diagnose import LayerFacts, RequestView, diagnose

    q, (k, v), _, prefix, causal = _layer()
    transform, _ = CAP_MISTAKES["without the division"]
    wrong = _capped(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), causal, lambda s: transform(s, 2.0)
    )
    message = diagnose(wrong, [RequestView(q, k, v, prefix)], LayerFacts(4, 2, 0.25, logit_cap=2.0), 1e-9)
    assert message is not None, message
    assert "the softmax scale doubled" in message and "the division by the cap inside tanh left out" in message
    assert "multiplied by 2" in message and "is the score divided by the cap?" in message, message


def test_ignored_sinks_are_named() -> None:
    import torch

    from attnhost.testing.diagnose import LayerFacts, RequestView, diagnose

    q, (k, v), _, prefix, causal = _layer()
    facts = LayerFacts(4, 2, 0.25, sinks=torch.tensor([0.5, -1.0, 2.0, 1.0]))
    wrong = _sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), causal)
    message = diagnose(wrong, [RequestView(q, k, v, prefix)], facts, 1e-9)
    assert message is not None and message.startswith("the output matches attention without the sinks"), message


def test_a_non_finite_output_gets_no_diagnosis() -> None:
    """NaN compares false with every bound: it must not pass for a mistake, nor for a factor of nan."""
    import torch

    from attnhost.testing.diagnose import RequestView, diagnose

    q, (k, v), facts, prefix, _ = _layer()
    wrong = torch.full((5, 4, 16), float("nan"), dtype=torch.float64)
    assert diagnose(wrong, [RequestView(q, k, v, prefix)], facts, 1e-9) is None
