"""Run in a fresh interpreter with ``TRITON_INTERPRET=1``: SGLang's triton tree kernels vs the kit's torch stand-ins.

The inputs are what SGLang's draft loop makes: random draft distributions
through SGLang's own ``select_top_k_tokens`` (each step) and
``organize_draft_results``, ragged ``seq_lens``; the target's greedy tokens
follow a random tree path with a chance of leaving it, so verification accepts
some drafts and rejects others. Both implementations get identical copies of
every buffer; every buffer they write must come out identical. Prints one
``CHECK-JSON`` line per case.

Usage: ``python spec_kernels_check.py CASES_JSON`` with cases
``[{"name", "bs", "topk", "steps", "draft_tokens", "seed"}]``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

from attnhost_sglang_cpu import shim

shim.install()

import torch  # noqa: E402

VOCAB = 40


def draft_round(bs: int, topk: int, steps: int, dtn: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    scores: Any = None
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        rows = bs if i == 0 else bs * topk
        probs = torch.softmax(torch.randn(rows, VOCAB, generator=gen) * 3, dim=-1)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        _, _, scores, (s, t, p) = select_top_k_tokens(i, topk_p, topk_index, None, scores, topk)
        score_list.append(s)
        token_list.append(t)
        parents_list.append(p)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(score_list, token_list, parents_list, dtn)
    bonus = torch.randint(0, VOCAB, (bs,), generator=gen)
    candidates = torch.cat((bonus.unsqueeze(1), draft_tokens), dim=1)
    return parent_list, top_scores_index, candidates


def build_buffers(bs: int, dtn: int, seq_lens: torch.Tensor, mode: int) -> dict[str, torch.Tensor]:
    size = int(seq_lens.sum()) * dtn + dtn * dtn * bs if mode == 0 else dtn * dtn * bs
    retrieve = torch.full((3, bs, dtn), -1, dtype=torch.long)
    return {
        "tree_mask": torch.full((size,), True, dtype=torch.bool),
        "positions": torch.full((bs * dtn,), -7, dtype=torch.long),
        "retrieve_index": retrieve[0].clone(),
        "retrieve_next_token": retrieve[1].clone(),
        "retrieve_next_sibling": retrieve[2].clone(),
    }


def target_tokens(candidates: torch.Tensor, next_token: torch.Tensor, sibling: torch.Tensor, rng: random.Random):
    """A greedy target that usually picks one of each node's children (so drafts get accepted) and sometimes not."""
    bs, dtn = candidates.shape
    out = torch.empty((bs, dtn), dtype=torch.long)
    for b in range(bs):
        for j in range(dtn):
            children, child = [], int(next_token[b, j])
            while child != -1:
                children.append(child)
                child = int(sibling[b, child])
            if children and rng.random() < 0.75:
                out[b, j] = candidates[b, rng.choice(children)]
            else:
                out[b, j] = rng.randrange(VOCAB)
    return out


def diff(name: str, a: torch.Tensor, b: torch.Tensor) -> list[str]:
    if torch.equal(a, b):
        return []
    return [f"{name}: triton {a.tolist()} != stand-in {b.tolist()}"]


def check(case: dict[str, Any]) -> dict[str, Any]:
    from attnhost_sglang_cpu import spec_kernels
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton

    bs, topk, steps, dtn = case["bs"], case["topk"], case["steps"], case["draft_tokens"]
    gen = torch.Generator().manual_seed(case["seed"])
    rng = random.Random(case["seed"])
    parent_list, top_scores_index, candidates = draft_round(bs, topk, steps, dtn, gen)
    seq_lens = torch.tensor([rng.randint(1, 12) for _ in range(bs)], dtype=torch.long)
    problems: list[str] = []
    accepted = 0
    for mode in (0, 1):  # FULL_MASK, QLEN_ONLY
        ours, theirs = build_buffers(bs, dtn, seq_lens, mode), build_buffers(bs, dtn, seq_lens, mode)
        args = (parent_list, top_scores_index, seq_lens)
        sgl_build_tree_kernel_triton(*args, *theirs.values(), topk, steps, dtn, mode)
        spec_kernels.build_tree_kernel_efficient(*args, *ours.values(), topk, steps, dtn, mode)
        problems += [p for key in ours for p in diff(f"mode {mode} {key}", theirs[key], ours[key])]
    target = target_tokens(candidates, theirs["retrieve_next_token"], theirs["retrieve_next_sibling"], rng)

    def verify_buffers() -> dict[str, torch.Tensor]:
        return {
            "predicts": torch.zeros(bs * dtn, dtype=torch.int32),
            "accept_index": torch.full((bs, steps + 1), -1, dtype=torch.int32),
            "accept_token_num": torch.zeros(bs, dtype=torch.int32),
        }

    tree = (candidates, theirs["retrieve_index"], theirs["retrieve_next_token"], theirs["retrieve_next_sibling"])
    mine, ref = verify_buffers(), verify_buffers()
    verify_tree_greedy_triton(*ref.values(), *tree, target)
    spec_kernels.verify_tree_greedy(*mine.values(), *tree, target, topk=topk)
    problems += [p for key in ref for p in diff(f"verify {key}", ref[key], mine[key])]
    accepted = int(ref["accept_token_num"].sum())
    return {"name": case["name"], "problems": problems, "accepted": accepted, "bs": bs, "dtn": dtn}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1: SGLang's triton kernels are the reference")
    for case in json.loads(sys.argv[1]):
        print("CHECK-JSON " + json.dumps(check(case)), flush=True)


if __name__ == "__main__":
    main()
