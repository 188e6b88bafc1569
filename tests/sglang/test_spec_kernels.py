"""The kit's torch stand-ins for SGLang's two tree kernels equal SGLang's own triton kernels.

SGLang 0.5.23 refuses ``build_tree_kernel_efficient_func`` and
``verify_tree_greedy_func`` on any out-of-tree platform, so the test kit
(``attnhost_sglang_cpu.spec_kernels``) ports the triton kernels of the same
module to torch. Here both run on the same draft rounds, made by SGLang's own
draft-selection code, in a fresh interpreter with ``TRITON_INTERPRET=1`` (the
triton kernels then execute on the CPU): chains and trees with topk 2 and 3,
ragged prefixes, both tree-mask layouts (FULL_MASK, QLEN_ONLY), and greedy
verification with a target that accepts some drafts and rejects others.
Every buffer either writes must be identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from attnhost_sglang_cpu import sglang_env

CASES = [
    {"name": "chain-topk1-bs3", "bs": 3, "topk": 1, "steps": 3, "draft_tokens": 4, "seed": 1},
    {"name": "chain-topk1-bs1", "bs": 1, "topk": 1, "steps": 5, "draft_tokens": 6, "seed": 11},
    {"name": "tree-topk2-bs3", "bs": 3, "topk": 2, "steps": 3, "draft_tokens": 4, "seed": 2},
    {"name": "tree-topk2-wide", "bs": 2, "topk": 2, "steps": 4, "draft_tokens": 8, "seed": 4},
    {"name": "tree-topk3-bs2", "bs": 2, "topk": 3, "steps": 3, "draft_tokens": 6, "seed": 3},
    {"name": "tree-topk3-deep", "bs": 4, "topk": 3, "steps": 4, "draft_tokens": 9, "seed": 5},
]


@pytest.fixture(scope="module")
def checked() -> dict[str, dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("spec_kernels_check.py")), json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=sglang_env({"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"}),
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [
        json.loads(line.removeprefix("CHECK-JSON "))
        for line in result.stdout.splitlines()
        if line.startswith("CHECK-JSON ")
    ]
    return {record["name"]: record for record in lines if "name" in record}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_stand_ins_equal_sglangs_triton_kernels(case: dict[str, Any], checked: dict[str, dict[str, Any]]) -> None:
    record = checked[case["name"]]
    assert record["problems"] == [], "\n".join(record["problems"])


def test_the_cases_accept_some_drafts_and_reject_others(checked: dict[str, dict[str, Any]]) -> None:
    accepted = sum(record["accepted"] for record in checked.values())
    proposed = sum(case["bs"] * case["steps"] for case in CASES)
    assert 0 < accepted < proposed, checked
    assert sum(record["accepted"] > 0 for record in checked.values()) >= len(CASES) // 2, checked
