"""No host sync in a step: SGLang's batches through the adapter with every device tensor refusing host reads.

Each batch is one of SGLang's own test-kit fixtures (real pools, real ``RadixAttention``, the adapter built by
name through SGLang's ``ATTENTION_BACKENDS``): extend, decode, target-verify (EAGLE chain and tree, NGRAM, and
DFLASH with its host lengths only a bound), draft-extend and the draft's multi-step decode. Everything SGLang
keeps on its device (lengths, write slots, request rows, the request table, the tree mask, the activations) is
wrapped in :class:`~attnhost.testing.host_reads.DeviceOnly`, so a read anywhere in the adapter or the backend
(``batched_matmul``, which declares graph support) raises; the outputs are then checked against SGLang's own
reference, DFLASH's included, so a backend that planned from the bound would fail.
"""

from __future__ import annotations

import dataclasses
import unittest
from typing import Any

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.spec_verify import SPEC_VERIFY_KINDS, spec_verify_case, spec_verify_id  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.speculative.draft_utils import DraftBackendFactory  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    build_dense_attention_fixture,
    dense_attention_reference_with_custom_mask,
    dense_fixture_inputs,
    expected_dense_fixture_output,
    make_dense_cases,
    run_dense_forward,
)
from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as verify_kit  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes.speculative_draft_extend_runner import (  # noqa: E402
    _prepare_eagle_draft_extend_v2_batch,
)

from attnhost import BackendFailedError  # noqa: E402
from attnhost.testing.host_reads import HostReadError, device_only, no_host_reads  # noqa: E402

BACKEND = "batched_matmul"
DEVICE_FIELDS = ("seq_lens", "out_cache_loc", "req_pool_indices", "extend_prefix_lens", "extend_seq_lens", "positions")


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _on_device(fixture: Any, batch: Any, inputs: dict[str, Any] | None = None) -> None:
    """Wrap what SGLang keeps on its device, in place: the batch's tensors, the request table, the tree mask and
    the layer's input (the host copies, ``*_cpu``, stay plain)."""
    for name in DEVICE_FIELDS:
        value = getattr(batch, name, None)
        if isinstance(value, torch.Tensor):
            setattr(batch, name, device_only(value))
    pool = fixture.runner.req_to_token_pool
    pool.req_to_token = device_only(pool.req_to_token)
    spec = batch.spec_info
    if spec is not None and isinstance(getattr(spec, "custom_mask", None), torch.Tensor):
        spec.custom_mask = device_only(spec.custom_mask)
    if inputs is not None:
        inputs["input_hidden"] = device_only(inputs["input_hidden"])


def _step(fixture: Any, batch: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """One planned step, reads refused throughout; the output as a plain tensor."""
    with torch.no_grad(), no_host_reads(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(batch)
        out = run_dense_forward(fixture, batch, inputs)
    return out.as_subclass(torch.Tensor)


def _fixture(case: DenseAttentionCase) -> Any:
    with torch.no_grad():
        return build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)


def _dense_cases() -> dict[str, DenseAttentionCase]:
    cases = {}
    for case in make_dense_cases(BACKEND):
        if case.page_size == 1 and case.forward_mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            cases.setdefault(case.forward_mode.name.lower(), case)
    return cases


@pytest.mark.parametrize("mode", sorted(_dense_cases()))
def test_extend_and_decode_read_nothing_on_the_host(mode: str) -> None:
    fixture = _fixture(_dense_cases()[mode])
    batch = fixture.forward_batch
    inputs = dense_fixture_inputs(fixture)
    expected = expected_dense_fixture_output(fixture)
    _on_device(fixture, batch, inputs)
    torch.testing.assert_close(_step(fixture, batch, inputs), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", SPEC_VERIFY_KINDS, ids=[spec_verify_id(*kind) for kind in SPEC_VERIFY_KINDS])
def test_target_verify_reads_nothing_on_the_host(kind: tuple[str, int, bool]) -> None:
    """Every verify input of SGLang's kit, trees in SGLang's own layout; DFLASH with a host bound stays right."""
    spec_kind, topk, host_bound = kind
    case = spec_verify_case(BACKEND, (5, 9), (4, 2), topk)
    fixture = _fixture(case)
    batch = fixture.forward_batch
    verify_kit._prepare_target_verify_batch(batch, case, "cpu")
    if host_bound:  # DFLASH's worker: the host's lengths are the committed ones plus the block size
        batch.seq_lens_cpu = batch.seq_lens_cpu + case.extend_lens[0]
    reference_case, masks = verify_kit._expected_case_and_masks_for_spec_verify(
        case, topk=topk, spec_kind=spec_kind, device="cpu"
    )
    batch.spec_info = verify_kit._make_spec_verify_input(case, batch, topk=topk, device="cpu", spec_kind=spec_kind)
    inputs = dense_fixture_inputs(fixture)
    with torch.no_grad():
        expected = dense_attention_reference_with_custom_mask(
            fixture.reference_module, reference_case, inputs["prefix_hidden"], inputs["input_hidden"], masks
        )
    _on_device(fixture, batch, inputs)
    torch.testing.assert_close(_step(fixture, batch, inputs), expected, atol=2e-5, rtol=2e-5)


def test_draft_extend_reads_nothing_on_the_host() -> None:
    case = DenseAttentionCase(
        name="spec_draft_extend_v2",
        backend=BACKEND,
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        num_heads=4,
        num_kv_heads=2,
        page_size=1,
        prefix_lens=(6, 11, 3),
        extend_lens=(4, 4, 4),
    )
    fixture = _fixture(dataclasses.replace(case, forward_mode=ForwardMode.EXTEND))
    batch = fixture.forward_batch
    batch.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    _prepare_eagle_draft_extend_v2_batch(case, batch, device="cpu")
    inputs = dense_fixture_inputs(fixture)
    expected = expected_dense_fixture_output(fixture)
    _on_device(fixture, batch, inputs)
    torch.testing.assert_close(_step(fixture, batch, inputs), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("topk", [1, 2])
def test_draft_decode_steps_read_nothing_on_the_host(topk: int) -> None:
    """The draft's multi-step container plans a round and runs each step; every row against float64 attention
    over its prefix and its own branch."""
    steps = 3
    case = DenseAttentionCase(
        name="draft_decode",
        backend=BACKEND,
        forward_mode=ForwardMode.DECODE,
        num_heads=4,
        num_kv_heads=2,
        page_size=1,
        prefix_lens=(9, 4, 13),
        extend_lens=(),
    )
    fixture = _fixture(case)
    fixture.runner.is_draft_worker = True
    fixture.runner.draft_attention_backend = BACKEND
    with torch.no_grad():
        container = DraftBackendFactory(fixture.runner, topk, steps).create_decode_backend()
    batch, layer = fixture.forward_batch, fixture.actual_module.attn
    runner, bs = fixture.runner, batch.batch_size
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token.clone()
    prefix = batch.seq_lens_cpu.tolist()
    first_free = table.numel() // 2
    loc = torch.arange(first_free, first_free + bs * topk * steps)
    loc = loc[torch.randperm(len(loc), generator=torch.Generator().manual_seed(7))]
    batch.out_cache_loc = loc
    _on_device(fixture, batch)
    per_row = loc.view(bs * topk, steps)
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    torch.manual_seed(3)
    with torch.no_grad(), no_host_reads():
        container.init_forward_metadata(batch)
    for step, child in enumerate(container.attn_backends):
        rows = bs * topk
        q, k, v = torch.randn(rows, heads * dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
        batch.out_cache_loc = device_only(per_row[:, step].clone())
        with torch.no_grad(), no_host_reads(), forward_context(ForwardContext(attn_backend=child)):
            out = child.forward(device_only(q), device_only(k), device_only(v), layer, batch)
        out = out.as_subclass(torch.Tensor).view(rows, heads, dim)
        keys_all, values_all = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        for row in range(rows):
            b = row // topk
            slots = torch.cat([table[int(batch.req_pool_indices[b]), : prefix[b]].long(), per_row[row, : step + 1]])
            keys = keys_all[slots].double().repeat_interleave(heads // kv_heads, dim=1)
            values = values_all[slots].double().repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("hd,shd->hs", q.view(rows, heads, dim)[row].double(), keys) * layer.scaling
            expected = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
            torch.testing.assert_close(out[row].double(), expected, atol=2e-5, rtol=2e-5, msg=f"step {step}, row {row}")


def test_a_backend_that_reads_on_the_host_is_caught() -> None:
    """The detector is live: torch_native plans from the slots' values (it declares no graph support), and the
    same extend batch through it fails in the backend's own planning, the read named, not in the adapter's."""
    case = dataclasses.replace(_dense_cases()["extend"], backend="attnhost_torch_native")
    fixture = _fixture(case)
    batch = fixture.forward_batch
    inputs = dense_fixture_inputs(fixture)
    _on_device(fixture, batch, inputs)
    with pytest.raises(BackendFailedError, match=r"'torch_native'.*failed in init_forward_metadata") as caught:
        _step(fixture, batch, inputs)
    assert isinstance(caught.value.__cause__, HostReadError)
