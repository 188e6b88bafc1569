"""SGLang's own speculative target-verify kit, for every verify input SGLang has (used by tests/sglang and the suite).

SGLang's kit (``speculative_target_verify_runner``) builds a target-verify
batch on its dense fixture for each ``spec_kind`` (EAGLE, frozen-KV MTP,
DFLASH, NGRAM) and compares the backend with its masked reference. The verify
inputs differ in what they carry: NGRAM's has no ``topk`` at all, so a backend
that reads the tree's shape from ``topk`` computes a tree as a chain. Each kind
runs here as a chain, and as the kit's tree (root and two branches) where the
kind can be a tree.

One more variant mirrors DFLASH's worker: it hands the verify batch a host
``seq_lens_cpu`` that is only a planning bound (the committed length plus the
block size) beside the committed lengths on the device. The kit's own steps run
with that host copy, so a backend that plans from it attends to slots that hold
nothing yet and fails the kit's comparison.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
    DenseAttentionCase,
    build_dense_attention_fixture,
    dense_attention_reference_with_custom_mask,
    dense_fixture_inputs,
    run_dense_forward,
)
from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as kit

from attnhost_sglang_cpu.dense import KitCase

__all__ = ["SPEC_VERIFY_KINDS", "run_spec_verify_case", "spec_verify_case"]

#: ``(spec_kind, topk, host_bound)``: every verify input of SGLang's kit, chains and trees, and DFLASH's host bound.
SPEC_VERIFY_KINDS: tuple[tuple[str, int, bool], ...] = (
    ("eagle", 1, False),
    ("eagle", 2, False),
    ("frozen_kv_mtp", 1, False),
    ("frozen_kv_mtp", 2, False),
    ("dflash", 1, False),
    ("dflash", 1, True),
    ("ngram", 1, False),
    ("ngram", 2, False),
)


def spec_verify_id(spec_kind: str, topk: int, host_bound: bool) -> str:
    return f"{spec_kind}-{'chain' if topk == 1 else 'tree'}{'-host_bound' if host_bound else ''}"


def spec_verify_case(
    backend: str, prefix_lens: tuple[int, ...] = (5, 9), heads: tuple[int, int] = (4, 2), topk: int = 1
) -> DenseAttentionCase:
    """A verify case of SGLang's kit: its tree coverage is hard-coded to three draft tokens, chains get four."""
    draft_tokens = 4 if topk == 1 else 3
    return DenseAttentionCase(
        name=f"spec_verify_{'chain' if topk == 1 else 'tree'}",
        backend=backend,
        forward_mode=ForwardMode.TARGET_VERIFY,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        page_size=1,
        prefix_lens=prefix_lens,
        extend_lens=(draft_tokens,) * len(prefix_lens),
    )


def run_spec_verify_case(
    case: DenseAttentionCase, *, spec_kind: str, topk: int, dtype: torch.dtype, host_bound: bool = False
) -> None:
    """``run_dense_spec_verify_case``'s steps, with the host lengths made DFLASH's bound when ``host_bound``;
    a failure leads with the backend, the verify kind and the error size."""
    with torch.no_grad():
        fixture = build_dense_attention_fixture(KitCase(), case, device="cpu", dtype=dtype)
        batch = fixture.forward_batch
        kit._prepare_target_verify_batch(batch, case, "cpu")
        if host_bound:
            batch.seq_lens_cpu = batch.seq_lens_cpu + case.extend_lens[0]
        reference_case, masks = kit._expected_case_and_masks_for_spec_verify(
            case, topk=topk, spec_kind=spec_kind, device="cpu"
        )
        batch.spec_info = kit._make_spec_verify_input(case, batch, topk=topk, device="cpu", spec_kind=spec_kind)
        inputs = dense_fixture_inputs(fixture)
        expected = dense_attention_reference_with_custom_mask(
            fixture.reference_module, reference_case, inputs["prefix_hidden"], inputs["input_hidden"], masks
        )
        with forward_context(ForwardContext(attn_backend=fixture.backend)):
            fixture.backend.init_forward_metadata(batch)
            actual = run_dense_forward(fixture, batch, inputs)
    diff = (actual.double() - expected.double()).abs()
    allowed = kit.DENSE_ATOL + kit.DENSE_RTOL * expected.double().abs()  # assert_close's rule, the kit's tolerances
    if not bool((diff <= allowed).all()):
        raise AssertionError(
            f"backend {case.backend!r}, SGLang's verify kit, {spec_verify_id(spec_kind, topk, host_bound)} "
            f"({str(dtype).removeprefix('torch.')}, prefixes {case.prefix_lens}): max abs error "
            f"{diff.max().item():.3g} exceeds SGLang's tolerance (atol {kit.DENSE_ATOL}, rtol {kit.DENSE_RTOL})"
        )
