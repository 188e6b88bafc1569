"""Greedy speculative decoding on the CPU: a target and a draft, each with its own runner and backend.

A tiny random-weight transformer is the target; a noisy copy of it is the
draft (so it agrees often, but not always). Each has its own ``ModelRunner``,
and so its own KV cache and its own attention backend: the draft runs on a
draft-capable plugin backend from ``examples/`` when one is installed, on
``torch_native`` otherwise. Every round the draft proposes ``k`` tokens (k
DECODE forwards), the target verifies them in one TARGET_VERIFY forward, and
the draft catches up on accepted tokens with a DRAFT_EXTEND forward.

The model code dispatches exactly as SGLang's does: per layer it asks
``attnhost.dispatch_attention_backend(mode)`` and ``attnhost.get_attn_backend()``,
which answer for whichever runner's forward context is active — so the draft
can never make the target run the draft's kernel (SGLang #28559). The demo
records those answers and prints them, and checks that speculative decoding
produced exactly the target's own greedy output.

Run: ``python examples/speculative_demo.py [--steps N] [--k K] [--draft-backend NAME] [--seed S]``
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import NoReturn

import torch

import attnhost
from attnhost import ForwardMode, ModelRunner, ServerArgs
from attnhost.availability import check_availability

VOCAB = 96
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
MAX_POSITIONS = 512


@dataclass
class Weights:
    """A tiny decoder-only transformer's parameters (pre-norm, learned positions, GQA attention)."""

    embed: torch.Tensor
    positions: torch.Tensor
    wq: list[torch.Tensor]
    wk: list[torch.Tensor]
    wv: list[torch.Tensor]
    wo: list[torch.Tensor]
    w1: list[torch.Tensor]
    w2: list[torch.Tensor]
    head: torch.Tensor

    @classmethod
    def random(cls, generator: torch.Generator) -> Weights:
        def randn(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=generator) * scale

        per_layer = range(LAYERS)
        return cls(
            embed=randn(VOCAB, HIDDEN, scale=1.0),
            positions=randn(MAX_POSITIONS, HIDDEN, scale=0.5),
            wq=[randn(HIDDEN, HEADS * HEAD_DIM, scale=HIDDEN**-0.5) for _ in per_layer],
            wk=[randn(HIDDEN, KV_HEADS * HEAD_DIM, scale=HIDDEN**-0.5) for _ in per_layer],
            wv=[randn(HIDDEN, KV_HEADS * HEAD_DIM, scale=HIDDEN**-0.5) for _ in per_layer],
            wo=[randn(HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5) for _ in per_layer],
            w1=[randn(HIDDEN, 4 * HIDDEN, scale=HIDDEN**-0.5) for _ in per_layer],
            w2=[randn(4 * HIDDEN, HIDDEN, scale=(4 * HIDDEN) ** -0.5) for _ in per_layer],
            head=randn(HIDDEN, VOCAB, scale=HIDDEN**-0.5),
        )

    def perturbed(self, generator: torch.Generator, noise: float) -> Weights:
        """A draft model: the same network with a little noise, so it mostly agrees with the target."""

        def jitter(t: torch.Tensor) -> torch.Tensor:
            return t + torch.randn(t.shape, generator=generator) * noise * t.std()

        def each(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [jitter(t) for t in ts]

        return Weights(
            jitter(self.embed),
            self.positions,
            each(self.wq),
            each(self.wk),
            each(self.wv),
            each(self.wo),
            each(self.w1),
            each(self.w2),
            jitter(self.head),
        )


class TinyModel:
    """Runs forwards through one runner; records which backend each layer dispatched to."""

    def __init__(self, name: str, weights: Weights, runner: ModelRunner) -> None:
        self.name = name
        self.weights = weights
        self.runner = runner
        self.request = runner.new_request()
        self.cached_len = 0
        self.dispatched: dict[ForwardMode, set[str]] = defaultdict(set)

    def forward(self, mode: ForwardMode, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` (appended after the cached ones) and return their logits ``[len, VOCAB]``."""
        w = self.weights
        start = self.cached_len
        batch = self.runner.prepare_batch(mode, [(self.request, start, len(tokens))])
        x = w.embed[torch.tensor(tokens)] + w.positions[start : start + len(tokens)]
        with self.runner.forward_context():
            for i, layer in enumerate(self.runner.layers):
                h = torch.nn.functional.layer_norm(x, (HIDDEN,))
                q = (h @ w.wq[i]).view(-1, HEADS, HEAD_DIM)
                k = (h @ w.wk[i]).view(-1, KV_HEADS, HEAD_DIM)
                v = (h @ w.wv[i]).view(-1, KV_HEADS, HEAD_DIM)
                # What SGLang's per-layer dispatch does: ask the *current* runner's backend.
                self.dispatched[mode].add(attnhost.dispatch_attention_backend(mode))
                attn = attnhost.get_attn_backend().forward(q, k, v, layer, batch)
                x = x + attn.reshape(-1, HEADS * HEAD_DIM) @ w.wo[i]
                h = torch.nn.functional.layer_norm(x, (HIDDEN,))
                x = x + torch.nn.functional.gelu(h @ w.w1[i]) @ w.w2[i]
        self.cached_len += len(tokens)
        return torch.nn.functional.layer_norm(x, (HIDDEN,)) @ w.head

    def truncate(self, length: int) -> None:
        """Forget cached tokens past ``length`` (rejected proposals) and free their KV slots."""
        if length < self.cached_len:
            pool = self.runner.kv_pool
            pool.free_slots(pool.req_to_token[self.request, length : self.cached_len].clone())
            self.cached_len = length


def pick_draft_backend(requested: str | None) -> str:
    """A draft-capable backend from an installed example plugin, else torch_native."""
    if requested:
        return requested
    registry = attnhost.get_registry()
    platform = attnhost.current_platform()
    for entry in registry.entries():
        if entry.plugin != "builtin" and entry.draft and check_availability(entry, platform).available:
            return entry.name
    # torch_native is not in SGLang's draft list; declare it draft-capable the seed's way,
    # which must happen before the first ServerArgs freezes the registry.
    attnhost.add_draft_attention_backend_choices(["torch_native"])
    return "torch_native"


def greedy(model: TinyModel, prompt: list[int], new_tokens: int) -> list[int]:
    logits = model.forward(ForwardMode.EXTEND, prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < new_tokens:
        out.append(int(model.forward(ForwardMode.DECODE, [out[-1]])[-1].argmax()))
    return out


def speculate(
    target: TinyModel, draft: TinyModel, prompt: list[int], new_tokens: int, k: int
) -> tuple[list[int], int, int]:
    """Greedy speculative decoding; returns the new tokens, proposals made and proposals accepted."""
    first = int(target.forward(ForwardMode.EXTEND, prompt)[-1].argmax())
    draft.forward(ForwardMode.EXTEND, prompt)
    tokens = [*prompt, first]
    proposed = accepted = 0
    while len(tokens) - len(prompt) < new_tokens:
        # Invariant: both caches hold every committed token but the last.
        proposals: list[int] = []
        for _ in range(k):
            last = proposals[-1] if proposals else tokens[-1]
            proposals.append(int(draft.forward(ForwardMode.DECODE, [last])[-1].argmax()))
        base = target.cached_len
        verify = target.forward(ForwardMode.TARGET_VERIFY, [tokens[-1], *proposals]).argmax(dim=-1).tolist()
        matched = 0
        while matched < k and proposals[matched] == verify[matched]:
            matched += 1
        proposed += k
        accepted += matched
        tokens += [*proposals[:matched], verify[matched]]
        target.truncate(base + matched + 1)
        draft.truncate(min(draft.cached_len, len(tokens) - 1))
        missing = tokens[draft.cached_len : len(tokens) - 1]
        if missing:
            draft.forward(ForwardMode.DRAFT_EXTEND, missing)
    return tokens[len(prompt) : len(prompt) + new_tokens], proposed, accepted


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line on stderr (exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speculative_demo.py", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=_positive, default=24, help="new tokens to generate (default: %(default)s)")
    parser.add_argument(
        "--k", type=_positive, default=4, help="tokens the draft proposes per round (default: %(default)s)"
    )
    parser.add_argument(
        "--draft-backend",
        default=None,
        metavar="NAME",
        help="the draft runner's backend (default: the first draft-capable backend an installed plugin "
        "provides that runs here, else torch_native)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights and prompt (default: %(default)s)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        return _run(options)
    except attnhost.AttnhostError as exc:  # an unknown or unavailable --draft-backend, say
        print(f"speculative_demo.py: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1


def _run(options: argparse.Namespace) -> int:
    generator = torch.Generator().manual_seed(options.seed)
    target_weights = Weights.random(generator)
    draft_weights = target_weights.perturbed(generator, noise=0.15)
    prompt = torch.randint(0, VOCAB, (12,), generator=generator).tolist()

    draft_backend = pick_draft_backend(options.draft_backend)
    args = ServerArgs(attention_backend="torch_native", speculative_draft_attention_backend=draft_backend)
    shape = dict(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_requests=2)
    target = TinyModel("target", target_weights, ModelRunner(args, **shape))  # type: ignore[arg-type]
    draft = TinyModel("draft", draft_weights, ModelRunner(args, is_draft=True, **shape))  # type: ignore[arg-type]
    reference = TinyModel("reference", target_weights, ModelRunner(args, **shape))  # type: ignore[arg-type]

    tokens, proposed, accepted = speculate(target, draft, prompt, options.steps, options.k)
    expected = greedy(reference, prompt, options.steps)

    registry = attnhost.get_registry()
    print(f"args: {args}")
    for model in (target, draft):
        backend = model.runner.attn_backend
        origin = registry.entry(backend.prefill_attention_backend_str or "")
        print(
            f"{model.name} runner: {type(backend).__name__} from plugin {origin.plugin!r} "
            f"({origin.distribution} {origin.version}); stamped prefill={backend.prefill_attention_backend_str!r} "
            f"decode={backend.decode_attention_backend_str!r}"
        )
        for mode in sorted(model.dispatched):
            print(f"  {mode.name:<16} -> {', '.join(sorted(model.dispatched[mode]))}")
    print(f"accepted {accepted}/{proposed} draft proposals; generated {len(tokens)} tokens")
    same = tokens == expected
    print(f"speculative output equals the target's own greedy output: {'yes' if same else 'NO'}")
    isolated = (
        target.dispatched.keys()
        and all(names == {"torch_native"} for names in target.dispatched.values())
        and all(names == {draft_backend} for names in draft.dispatched.values())
    )
    print(f"each runner dispatched only to its own backend: {'yes' if isolated else 'NO'}")
    return 0 if same and isolated else 1


if __name__ == "__main__":
    sys.exit(main())
