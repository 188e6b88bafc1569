"""Greedy speculative decoding on the CPU: a target and a draft, each with its own runner and backend.

A tiny random-weight transformer is the target; a noisy copy of it is the
draft (so it agrees often, but not always). Each has its own ``ModelRunner``,
and so its own KV cache and its own attention backend: the draft runs on a
draft-capable plugin backend from ``examples/`` when one is installed, on
``torch_native`` otherwise. Every round the draft proposes ``k`` tokens (k
DECODE forwards), the target verifies them in one TARGET_VERIFY forward, and
the draft catches up on accepted tokens with a DRAFT_EXTEND forward.

With ``--topk 2`` (or more) the draft proposes a tree instead of a chain, as
EAGLE does: its ``topk`` best first tokens, each continued greedily on its own
*branch row* (a batch row whose slot table shares the request's prefix slots),
all branches in one DECODE batch per step. The target verifies the whole tree
in one TARGET_VERIFY forward whose ``tree_mask`` lets each draft token see only
the prefix and its own ancestors; the longest branch it agrees with is kept.

The model code dispatches exactly as SGLang's does: per layer it asks
``attnhost.dispatch_attention_backend(mode)`` and ``attnhost.get_attn_backend()``,
which answer for whichever runner's forward context is active — so the draft
can never make the target run the draft's kernel (SGLang #28559). The demo
records those answers and prints them, and checks that speculative decoding
produced exactly the target's own greedy output.

Run: ``python examples/speculative_demo.py [--steps N] [--k K] [--topk T] [--draft-backend NAME] [--seed S]``
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

    def forward(
        self,
        mode: ForwardMode,
        tokens: list[int],
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` (appended after the cached ones) and return their logits ``[len, VOCAB]``.

        A tree's tokens are cached in a row but sit at their depth: ``positions`` says where (default: in a row).
        """
        start = self.cached_len
        batch = self.runner.prepare_batch(mode, [(self.request, start, len(tokens))], tree_mask)
        logits = self._layers(mode, batch, tokens, positions or list(range(start, start + len(tokens))))
        self.cached_len += len(tokens)
        return logits

    def decode_rows(self, rows: list[int], position: int, tokens: list[int]) -> torch.Tensor:
        """One DECODE step of branch rows (request slots of their own) that all hold ``position`` cached tokens."""
        batch = self.runner.prepare_batch(ForwardMode.DECODE, [(row, position, 1) for row in rows])
        return self._layers(ForwardMode.DECODE, batch, tokens, [position] * len(rows))

    def _layers(
        self, mode: ForwardMode, batch: attnhost.ForwardBatch, tokens: list[int], positions: list[int]
    ) -> torch.Tensor:
        w = self.weights
        x = w.embed[torch.tensor(tokens)] + w.positions[torch.tensor(positions)]
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
        return torch.nn.functional.layer_norm(x, (HIDDEN,)) @ w.head

    def truncate(self, length: int) -> None:
        """Forget cached tokens past ``length`` (rejected proposals) and free their KV slots."""
        if length < self.cached_len:
            pool = self.runner.kv_pool
            pool.free_slots(pool.req_to_token[self.request, length : self.cached_len].clone())
            self.cached_len = length

    def keep(self, start: int, indices: list[int]) -> None:
        """Of the tokens cached from ``start`` on, keep those at ``indices`` (an accepted tree path), in a row."""
        pool = self.runner.kv_pool
        slots = pool.req_to_token[self.request, start : self.cached_len].clone()
        kept = torch.zeros(len(slots), dtype=torch.bool)
        kept[indices] = True
        pool.free_slots(slots[~kept])
        pool.req_to_token[self.request, start : start + len(indices)] = slots[indices]
        self.cached_len = start + len(indices)


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
        catch_up(draft, tokens)
    return tokens[len(prompt) : len(prompt) + new_tokens], proposed, accepted


def catch_up(draft: TinyModel, tokens: list[int]) -> None:
    """Bring the draft's cache to every committed token but the last, with one DRAFT_EXTEND forward."""
    draft.truncate(min(draft.cached_len, len(tokens) - 1))
    missing = tokens[draft.cached_len : len(tokens) - 1]
    if missing:
        draft.forward(ForwardMode.DRAFT_EXTEND, missing)


def propose_tree(draft: TinyModel, root: int, k: int, topk: int) -> list[list[int]]:
    """``topk`` branches of ``k`` draft tokens each: the draft's best first tokens after ``root``, each continued
    greedily on a branch row of its own, all branches in one DECODE batch per step."""
    logits = draft.forward(ForwardMode.DECODE, [root])[-1]
    branches = [[int(t)] for t in logits.topk(topk).indices]
    pool, prefix = draft.runner.kv_pool, draft.cached_len
    rows = [draft.runner.new_request() for _ in branches]
    for row in rows:  # a branch row holds the request's own prefix slots, shared, then slots of its branch
        pool.req_to_token[row, :prefix] = pool.req_to_token[draft.request, :prefix]
    for step in range(k - 1):
        logits = draft.decode_rows(rows, prefix + step, [branch[-1] for branch in branches])
        for branch, row_logits in zip(branches, logits, strict=True):
            branch.append(int(row_logits.argmax()))
    for row in rows:
        pool.free_slots(pool.req_to_token[row, prefix : prefix + k - 1].clone())
        pool.free_request(row)
    return branches


def tree_layout(branches: list[list[int]], start: int) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """The tree as the target verifies it: tokens (the root first), their parents, positions, and its mask."""
    tokens, parents, positions = [-1], [-1], [start]  # the root's token is the caller's
    for branch in branches:
        for depth, token in enumerate(branch):
            parents.append(0 if depth == 0 else len(tokens) - 1)
            tokens.append(token)
            positions.append(start + 1 + depth)
    mask = torch.eye(len(tokens), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]  # a token sees its ancestors (and the prefix, always)
    return tokens, parents, positions, mask.flatten()


def speculate_tree(
    target: TinyModel, draft: TinyModel, prompt: list[int], new_tokens: int, k: int, topk: int
) -> tuple[list[int], int, int]:
    """Greedy speculative decoding over draft trees; returns the new tokens, proposals made and accepted."""
    first = int(target.forward(ForwardMode.EXTEND, prompt)[-1].argmax())
    draft.forward(ForwardMode.EXTEND, prompt)
    tokens = [*prompt, first]
    proposed = accepted = 0
    while len(tokens) - len(prompt) < new_tokens:
        branches = propose_tree(draft, tokens[-1], k, topk)
        base = target.cached_len
        tree, parents, positions, mask = tree_layout(branches, base)
        tree[0] = tokens[-1]
        verify = target.forward(ForwardMode.TARGET_VERIFY, tree, positions, mask).argmax(dim=-1).tolist()
        path = [0]  # from the root, walk down while the target's own next token is one of the node's children
        while True:
            children = [node for node, parent in enumerate(parents) if parent == path[-1]]
            agreed = next((node for node in children if tree[node] == verify[path[-1]]), None)
            if agreed is None:
                break
            path.append(agreed)
        proposed += topk * k
        accepted += len(path) - 1
        tokens += [*(tree[node] for node in path[1:]), verify[path[-1]]]
        target.keep(base, path)
        catch_up(draft, tokens)
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
        "--topk",
        type=_positive,
        default=1,
        help="branches of the draft's tree (1: a chain; 2 or more: a tree verified with a tree mask) "
        "(default: %(default)s)",
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
    rows = options.topk if options.topk > 1 else 0  # the draft's branch rows
    shape = dict(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_requests=1 + rows)
    target = TinyModel("target", target_weights, ModelRunner(args, **shape))  # type: ignore[arg-type]
    draft = TinyModel("draft", draft_weights, ModelRunner(args, is_draft=True, **shape))  # type: ignore[arg-type]
    reference = TinyModel("reference", target_weights, ModelRunner(args, **shape))  # type: ignore[arg-type]

    if options.topk > 1:
        tokens, proposed, accepted = speculate_tree(target, draft, prompt, options.steps, options.k, options.topk)
    else:
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
    shape_text = f"trees of {options.topk} branches x {options.k}" if options.topk > 1 else f"chains of {options.k}"
    print(f"accepted {accepted}/{proposed} draft proposals ({shape_text}); generated {len(tokens)} tokens")
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
