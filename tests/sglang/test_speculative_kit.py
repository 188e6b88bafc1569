"""Speculative batches through the bridge, on SGLang's own test-kit fixtures.

Target verify runs SGLang's own verify kit for every verify input it has
(EAGLE, frozen-KV MTP, DFLASH, NGRAM: its tree masks, its reference), and
DFLASH's host lengths as a bound. Draft-extend-v2 uses the
kit's dense fixture and its own draft-extend-v2 batch preparation against
the kit's causal reference, also with the layers handed another
``ForwardBatch`` object describing the same batch (SGLang plans it on one
and runs on another). The multi-step draft-decode container is built by
SGLang's own ``DraftBackendFactory`` (through the bridge's hook) and each
step is checked against a plain softmax over the K/V the step wrote:
every branch row sees its request's prefix and its own branch only.
"""

from __future__ import annotations

import dataclasses
import unittest

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.spec_verify import (  # noqa: E402
    SPEC_VERIFY_KINDS,
    run_spec_verify_case,
    spec_verify_case,
    spec_verify_id,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.speculative.draft_utils import DraftBackendFactory  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    build_dense_attention_fixture,
    dense_fixture_inputs,
    expected_dense_fixture_output,
    run_dense_forward,
)
from sglang.test.kits.attention_unittest.runner_modes.speculative_draft_extend_runner import (  # noqa: E402
    _prepare_eagle_draft_extend_v2_batch,
)

from attnhost.engines.sglang.adapter import SGLangAdapterBackend, UnsupportedFeatureError  # noqa: E402
from attnhost.engines.sglang.batches import tree_blocks  # noqa: E402
from attnhost.engines.sglang.multistep import SGLangMultiStepDraftBackend  # noqa: E402

BACKENDS = ("attnhost_torch_native", "tiny", "batched_matmul")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _case(backend: str, mode: ForwardMode, prefix_lens: tuple[int, ...], extend: int, heads: tuple[int, int]):  # type: ignore[no-untyped-def]
    return DenseAttentionCase(
        name=f"spec_{mode.name.lower()}",
        backend=backend,
        forward_mode=mode,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        page_size=1,
        prefix_lens=prefix_lens,
        extend_lens=(extend,) * len(prefix_lens),
    )


LAYOUTS = (((5, 9), (4, 4)), ((3, 30, 12), (4, 2)), ((17,), (4, 1)))
VERIFY = [
    pytest.param(
        backend,
        kind,
        prefix,
        heads,
        dtype,
        id=f"{backend}-{spec_verify_id(*kind)}-{'_'.join(map(str, prefix))}-{dname}",
    )
    for backend in BACKENDS
    for kind in SPEC_VERIFY_KINDS
    # EAGLE's verify on every prefix and head layout; the other inputs differ from it only in what they carry
    for prefix, heads in (LAYOUTS if kind[0] == "eagle" else LAYOUTS[1:2])
    for dname, dtype in DTYPES.items()
]


@pytest.mark.parametrize(("backend", "kind", "prefix", "heads", "dtype"), VERIFY)
def test_target_verify_on_sglangs_own_verify_kit(
    backend: str, kind: tuple[str, int, bool], prefix: tuple[int, ...], heads: tuple[int, int], dtype: torch.dtype
) -> None:
    """Every verify input of SGLang's kit (EAGLE, frozen-KV MTP, DFLASH, NGRAM), chains (causal among the draft
    tokens) and the kit's tree (root + two branches, FULL_MASK), and DFLASH's host lengths as a bound."""
    spec_kind, topk, host_bound = kind
    case = spec_verify_case(backend, prefix, heads, topk)
    run_spec_verify_case(case, spec_kind=spec_kind, topk=topk, dtype=dtype, host_bound=host_bound)


def test_tree_masks_in_both_sglang_layouts_become_the_contracts_blocks() -> None:
    """FULL_MASK (prefix columns first) and QLEN_ONLY give the same per-request blocks; another size does not fit."""
    committed, n = (2, 3), 3
    blocks = [torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]])]
    pairs = zip(committed, blocks, strict=True)
    rows = [torch.cat([torch.ones(n, seq, dtype=torch.bool), b.bool()], dim=1) for seq, b in pairs]
    full = torch.cat([row.reshape(-1) for row in rows])
    qlen = torch.cat([b.bool().reshape(-1) for b in blocks])
    device_committed = torch.tensor(committed)
    blocks_of_full, fits = tree_blocks(full, device_committed, n)
    assert torch.equal(blocks_of_full, qlen) and fits is not None and bool(fits)
    assert torch.equal(tree_blocks(qlen, device_committed, n)[0], qlen)
    misfit = tree_blocks(full[:-1], device_committed, n)[1]
    assert misfit is not None and not bool(misfit)


def _draft_extend_fixture(backend: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    case = _case(backend, ForwardMode.DRAFT_EXTEND_V2, (6, 11, 3), 4, (4, 2))
    fixture = build_dense_attention_fixture(
        _KitCase(), dataclasses.replace(case, forward_mode=ForwardMode.EXTEND), device="cpu", dtype=dtype
    )
    fixture.forward_batch.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    _prepare_eagle_draft_extend_v2_batch(case, fixture.forward_batch, device="cpu")
    return fixture


@pytest.mark.parametrize("replanned", [False, True], ids=["same-object", "another-object"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_extend_v2_is_causal_attention_over_the_new_tokens(backend: str, replanned: bool) -> None:
    with torch.no_grad():
        fixture = _draft_extend_fixture(backend, torch.float32)
        batch = fixture.forward_batch
        inputs = dense_fixture_inputs(fixture)
        expected = expected_dense_fixture_output(fixture)
        with forward_context(ForwardContext(attn_backend=fixture.backend)):
            fixture.backend.init_forward_metadata(batch)
            run_on = dataclasses.replace(batch) if replanned else batch
            actual = run_dense_forward(fixture, run_on, inputs)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def test_a_batch_the_adapter_did_not_plan_is_still_refused() -> None:
    with torch.no_grad():
        fixture = _draft_extend_fixture("tiny", torch.float32)
        fixture.backend.init_forward_metadata(fixture.forward_batch)
        other = dataclasses.replace(fixture.forward_batch, out_cache_loc=fixture.forward_batch.out_cache_loc + 1)
        inputs = dense_fixture_inputs(fixture)
        with forward_context(ForwardContext(attn_backend=fixture.backend)), pytest.raises(RuntimeError, match="init_"):
            run_dense_forward(fixture, other, inputs)


def _draft_runner(backend: str, topk: int, steps: int):  # type: ignore[no-untyped-def]
    """A dense fixture's runner as a draft runner whose resolved draft backend is ``backend``, and SGLang's
    draft-backend factory for it."""
    case = dataclasses.replace(_case(backend, ForwardMode.DECODE, (9, 4, 13), 1, (4, 2)), extend_lens=())
    fixture = build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)
    fixture.runner.is_draft_worker = True
    fixture.runner.draft_attention_backend = backend  # what SGLang's draft resolver stamps on the draft runner
    return fixture, DraftBackendFactory(fixture.runner, topk, steps)


@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_decode_steps_attend_to_the_prefix_and_their_own_branch(backend: str, topk: int) -> None:
    steps = 3
    with torch.no_grad():
        fixture, factory = _draft_runner(backend, topk, steps)
        container = factory.create_decode_backend()
        assert isinstance(container, SGLangMultiStepDraftBackend)
        assert len(container.attn_backends) == steps - 1
        assert all(isinstance(child, SGLangAdapterBackend) for child in container.attn_backends)
        assert container.decode_attention_backend_str == backend  # SGLang's factory stamped it, children too
        assert {child.prefill_attention_backend_str for child in container.attn_backends} == {backend}
        assert len({id(child.attnhost_backend) for child in container.attn_backends}) == steps - 1
        _check_draft_round(fixture, container, topk, steps)


def _check_draft_round(fixture, container, topk: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    batch, layer = fixture.forward_batch, fixture.actual_module.attn
    runner, bs = fixture.runner, batch.batch_size
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    prefix = batch.seq_lens_cpu.tolist()
    free = torch.arange(table.shape[0] * table.shape[1] // 2, table.shape[0] * table.shape[1] // 2 + bs * topk * steps)
    loc = free[torch.randperm(len(free), generator=torch.Generator().manual_seed(7))]  # scattered draft slots
    batch.out_cache_loc = loc
    container.init_forward_metadata(batch)
    per_row = loc.view(bs * topk, steps)
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    torch.manual_seed(3)
    for step, child in enumerate(container.attn_backends):
        rows = bs * topk
        q, k, v = torch.randn(rows, heads * dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
        batch.out_cache_loc = per_row[:, step]
        with forward_context(ForwardContext(attn_backend=child)):
            out = child.forward(q, k, v, layer, batch).view(rows, heads, dim)
        keys_all, values_all = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        assert torch.equal(keys_all[per_row[:, step]], k), f"step {step}: K not written to the step's slots"
        for row in range(rows):
            b = row // topk
            slots = torch.cat([table[batch.req_pool_indices[b], : prefix[b]].long(), per_row[row, : step + 1]])
            keys = keys_all[slots].repeat_interleave(heads // kv_heads, dim=1)
            values = values_all[slots].repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("hd,shd->hs", q.view(rows, heads, dim)[row], keys) * layer.scaling
            expected = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
            torch.testing.assert_close(out[row], expected, atol=2e-5, rtol=2e-5, msg=f"step {step}, row {row}")


def test_sglangs_own_draft_names_keep_sglangs_maps_and_unknown_names_keep_sglangs_error() -> None:
    with torch.no_grad():
        _, factory = _draft_runner("tiny", 1, 3)
    factory.draft_attn_backend = "no_such_backend"
    with pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend no_such_backend"):
        factory.create_decode_backend()
    with pytest.raises(ValueError, match="EAGLE is not supported in attention backend no_such_backend"):
        factory.create_draft_extend_backend()
    factory.draft_attn_backend = "torch_native"  # SGLang's own, and not in SGLang's draft maps: SGLang's error
    with pytest.raises(ValueError, match="not supported in decode attention backend torch_native"):
        factory.create_decode_backend()


def test_a_draft_extend_backend_is_an_adapter_on_the_draft_runner() -> None:
    with torch.no_grad():
        _, factory = _draft_runner("batched_matmul", 2, 3)
        backend = factory.create_draft_extend_backend()
    assert isinstance(backend, SGLangAdapterBackend)
    assert backend.attnhost_name == "batched_matmul"
    assert (backend.prefill_attention_backend_str, backend.decode_attention_backend_str) == ("batched_matmul",) * 2


def test_a_tree_verify_reaching_a_backend_without_tree_masks_is_refused_never_computed() -> None:
    """The resolution hook refuses such a run first (test_speculative_engine); this is the adapter's own guard."""
    from attnhost import BackendCapabilities
    from attnhost_builtin.torch_native import TorchNativeAttnBackend

    case = _case("tiny", ForwardMode.TARGET_VERIFY, (5, 9), 3, (4, 4))
    with torch.no_grad():
        fixture = build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)
    chain_only = SGLangAdapterBackend(
        fixture.runner,
        engine_name="chain_only",
        attnhost_name="chain_only",
        origin="plugin 'probe'",
        factory=TorchNativeAttnBackend,
        capabilities=BackendCapabilities(tree_mask=False),
    )
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        _make_eagle_verify_input,
        _prepare_target_verify_batch,
    )

    _prepare_target_verify_batch(fixture.forward_batch, case, "cpu")
    fixture.forward_batch.spec_info = _make_eagle_verify_input(case, fixture.forward_batch, topk=2, device="cpu")
    with pytest.raises(UnsupportedFeatureError, match=r"'chain_only'.*does not support speculative tree verify"):
        chain_only.init_forward_metadata(fixture.forward_batch)
