"""SGLang's speculative graphs through the adapter: the target's verify graphs and the draft's decode graphs.

SGLang's CPU graph runner cannot run them here: ``CPUGraphRunner`` asserts "does not support speculative
inference yet" for a speculative target, and an EAGLE draft worker captures no graph where ``is_cpu()`` holds.
So they are driven in the order SGLang's CUDA runners call them, on CPU tensors: ``DecodeCudaGraphRunner`` in
TARGET_VERIFY (``init_cuda_graph_state``; at capture the static buffers, every request padding, through
``init_forward_metadata_out_graph(in_capture=True)``, then the layer; before each replay the buffers refilled with
``1..N`` live requests and a replay view whose ``out_cache_loc`` and ``custom_mask`` are the live requests' only)
and ``EAGLEDraftCudaGraphRunner`` over the multi-step container (the round padded to the captured size: request
row 0, the fill length, write slot 0; each step then runs on its slice of the round's write slots).

At every replay, with SGLang's tensors refusing host reads: the live rows equal SGLang's own verify reference (its
kit's masks, chains and trees, for each verify input) or a float64 softmax over the prefix and the row's own
branch; the padded rows write nowhere but slot 0; and every tensor the captured layers read is the one of the
capture.
"""

from __future__ import annotations

import copy
import dataclasses
import unittest
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.spec_verify import spec_verify_case  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.speculative.draft_utils import DraftBackendFactory  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    build_dense_attention_fixture,
    dense_attention_reference_with_custom_mask,
    dense_fixture_inputs,
)
from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as kit  # noqa: E402

from attnhost import UnsupportedFeatureError  # noqa: E402
from attnhost.engines.sglang.multistep import SGLangMultiStepDraftBackend  # noqa: E402
from attnhost.testing.host_reads import device_only, no_host_reads  # noqa: E402

PREFIX = (9, 4, 13, 6)
CAPTURED = len(PREFIX)
LIVE = (3, 1, 4, 2)
GRAPH_BACKENDS = ("tiny", "batched_matmul", "cpu_paged")


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _changed_slots(cache: torch.Tensor, before: torch.Tensor) -> set[int]:
    return set((cache != before).flatten(1).any(dim=1).nonzero().flatten().tolist())


# -- target verify ---------------------------------------------------------------------


class _VerifyRunner:
    """A verify fixture of SGLang's kit and the static buffers of ``DecodeCudaGraphRunner`` for it."""

    def __init__(self, backend: str, spec_kind: str, topk: int) -> None:
        case = spec_verify_case(backend, prefix_lens=PREFIX, topk=topk)
        self.n = case.extend_lens[0]
        with torch.no_grad():
            fixture = build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)
        batch = fixture.forward_batch
        kit._prepare_target_verify_batch(batch, case, "cpu")
        batch.spec_info = kit._make_spec_verify_input(case, batch, topk=topk, device="cpu", spec_kind=spec_kind)
        reference_case, masks = kit._expected_case_and_masks_for_spec_verify(
            case, topk=topk, spec_kind=spec_kind, device="cpu"
        )
        inputs = dense_fixture_inputs(fixture)
        with torch.no_grad():
            self.expected = dense_attention_reference_with_custom_mask(
                fixture.reference_module, reference_case, inputs["prefix_hidden"], inputs["input_hidden"], masks
            )
        self.fixture, self.batch, self.hidden = fixture, batch, inputs["input_hidden"]
        self.adapter = fixture.backend
        self.adapter.init_cuda_graph_state(CAPTURED, CAPTURED * self.n)
        self.fill = self.adapter.get_cuda_graph_seq_len_fill_value()
        self.seq_lens = torch.full((CAPTURED,), self.fill, dtype=torch.int64)
        self.rows = torch.zeros(CAPTURED, dtype=torch.int64)
        self.loc = torch.zeros(CAPTURED * self.n, dtype=torch.int64)
        pool, layer = fixture.runner.token_to_kv_pool, fixture.actual_module.attn
        self.caches = (pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id))

    def _view(self, spec_info: Any, loc: torch.Tensor, wrap: Any) -> SimpleNamespace:
        return SimpleNamespace(
            batch_size=CAPTURED,
            forward_mode=ForwardMode.TARGET_VERIFY,
            seq_lens=wrap(self.seq_lens),
            seq_lens_cpu=None,
            req_pool_indices=wrap(self.rows),
            out_cache_loc=wrap(loc),
            spec_info=spec_info,
            encoder_lens=None,
        )

    def _run(self, view: SimpleNamespace, live: int) -> torch.Tensor:
        hidden = torch.zeros(CAPTURED * self.n, self.hidden.shape[1], dtype=self.hidden.dtype)
        hidden[: live * self.n] = self.hidden[: live * self.n]
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.adapter)):
            out: torch.Tensor = self.fixture.actual_module(hidden, view)
        return out

    def capture(self) -> None:
        spec_info = copy.copy(self.batch.spec_info)
        if getattr(spec_info, "custom_mask", None) is not None:  # SGLang's scratch mask buffer, never meaningful
            spec_info.custom_mask = torch.zeros(CAPTURED * self.n * 64, dtype=torch.bool)
        self.captured = self._view(spec_info, self.loc, lambda t: t)
        self.adapter.init_forward_metadata_out_graph(self.captured, in_capture=True)
        self.adapter.init_forward_metadata_in_graph(self.captured)
        self._run(self.captured, 0)  # the warm-up run before capture

    def _live_mask(self, live: int) -> torch.Tensor | None:
        """The live requests' part of the kit's mask, in whichever of SGLang's layouts the kit built."""
        mask = getattr(self.batch.spec_info, "custom_mask", None)
        if mask is None:
            return None
        n = self.n
        if mask.numel() == CAPTURED * n * n:  # QLEN_ONLY
            return mask[: live * n * n]
        return mask[: sum((p + n) * n for p in PREFIX[:live])]  # FULL_MASK

    def replay(self, live: int) -> tuple[torch.Tensor, list[int]]:
        n = self.n
        self.seq_lens.fill_(self.fill)
        self.rows.zero_()
        self.seq_lens[:live] = self.batch.seq_lens[:live]
        self.rows[:live] = self.batch.req_pool_indices[:live]
        loc = self.batch.out_cache_loc[: live * n].to(torch.int64)
        spec_info = copy.copy(self.batch.spec_info)
        mask = self._live_mask(live)
        if mask is not None:
            spec_info.custom_mask = device_only(mask)
        before = tuple(cache.clone() for cache in self.caches)
        view = self._view(spec_info, loc, device_only)
        with no_host_reads():
            self.adapter.init_forward_metadata_out_graph(view)
            out = self._run(view, live)
        slots = loc.tolist()
        for cache, old in zip(self.caches, before, strict=True):
            assert _changed_slots(cache, old) <= {*slots, 0}, "a padded row wrote a live slot"
        return out.as_subclass(torch.Tensor), slots


def _verify_storage(adapter: Any) -> dict[str, int]:
    graphs = adapter._graphs.verify
    found = {
        name: tensor.data_ptr()
        for name, tensor in (
            ("committed", graphs.rows.committed),
            ("slots", graphs.rows.slots),
            ("table", graphs.rows.table),
            ("seq_lens", graphs.seq_lens),
        )
    }
    if graphs.tree_mask is not None:
        found["tree_mask"] = graphs.tree_mask.data_ptr()
    return found


VERIFY_KINDS = [("eagle", 1), ("eagle", 2), ("ngram", 2), ("dflash", 1)]


@pytest.mark.parametrize(("spec_kind", "topk"), VERIFY_KINDS, ids=[f"{k}-topk{t}" for k, t in VERIFY_KINDS])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_verify_replays_with_padding_match_sglangs_verify_reference(backend: str, spec_kind: str, topk: int) -> None:
    runner = _VerifyRunner(backend, spec_kind, topk)
    runner.capture()
    planned, table = runner.adapter._batch, runner.adapter.kv_view.slot_table
    storage = _verify_storage(runner.adapter)
    assert (planned.tree_mask is not None) == (topk > 1), "a chain got a tree mask, or a tree none"
    for live in LIVE:
        out, _ = runner.replay(live)
        rows = live * runner.n
        torch.testing.assert_close(out[:rows], runner.expected[:rows], atol=kit.DENSE_ATOL, rtol=kit.DENSE_RTOL)
        assert bool(torch.isfinite(out).all()), "a padded row's output is not finite"
        assert runner.adapter._batch is planned, "the replay planned another batch than the captured one"
        assert runner.adapter.kv_view.slot_table is table, "the replay reads another slot table than the captured one"
        assert _verify_storage(runner.adapter) == storage, "a tensor the captured layers read moved"


def test_a_verify_graph_over_masks_a_backend_cannot_take_is_refused_at_capture() -> None:
    """NGRAM's verify input has no ``topk``: only a read of each step's mask could tell a chain, which a graph
    cannot make, so a backend without ``tree_mask`` is refused when the graph is captured, with the way out."""
    runner = _VerifyRunner("tiny", "ngram", 2)
    runner.adapter.capabilities = dataclasses.replace(runner.adapter.capabilities, tree_mask=False)
    with pytest.raises(UnsupportedFeatureError, match=r"'tiny'.*NgramVerifyInput.*--disable-cuda-graph"):
        runner.capture()


# -- draft decode ----------------------------------------------------------------------


def _draft_container(backend: str, topk: int, steps: int) -> tuple[Any, SGLangMultiStepDraftBackend]:
    case = DenseAttentionCase(
        name="graph_draft",
        backend=backend,
        forward_mode=ForwardMode.DECODE,
        num_heads=4,
        num_kv_heads=2,
        page_size=1,
        prefix_lens=PREFIX,
        extend_lens=(),
    )
    with torch.no_grad():
        fixture = build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)
    fixture.runner.is_draft_worker = True
    fixture.runner.draft_attention_backend = backend  # what SGLang's draft resolver stamps on the draft runner
    container = DraftBackendFactory(fixture.runner, topk, steps).create_decode_backend()
    assert isinstance(container, SGLangMultiStepDraftBackend)
    return fixture, container


class _DraftRunner:
    """``EAGLEDraftCudaGraphRunner``'s static buffers over the container, and its capture and replays."""

    def __init__(self, backend: str, topk: int, steps: int) -> None:
        self.fixture, self.container = _draft_container(backend, topk, steps)
        self.topk, self.steps = topk, steps
        self.container.init_cuda_graph_state(CAPTURED, CAPTURED * topk)
        self.fill = self.container.attn_backends[0].get_cuda_graph_seq_len_fill_value()
        self.seq_lens = torch.full((CAPTURED,), self.fill, dtype=torch.int64)
        self.rows = torch.zeros(CAPTURED, dtype=torch.int64)
        self.loc = torch.zeros(CAPTURED * topk * steps, dtype=torch.int64)
        self.spec_info = SimpleNamespace(topk_p=torch.zeros(CAPTURED, topk))
        self.layer = self.fixture.actual_module.attn
        pool = self.fixture.runner.token_to_kv_pool
        self.caches = (pool.get_key_buffer(self.layer.layer_id), pool.get_value_buffer(self.layer.layer_id))

    def _round(self, wrap: Any) -> SimpleNamespace:
        return SimpleNamespace(
            batch_size=CAPTURED,
            forward_mode=ForwardMode.DECODE,
            seq_lens=wrap(self.seq_lens),
            seq_lens_cpu=None,
            req_pool_indices=wrap(self.rows),
            out_cache_loc=wrap(self.loc),
            spec_info=self.spec_info,
            encoder_lens=None,
        )

    def _steps(self, batch: SimpleNamespace, seed: int) -> list[tuple[torch.Tensor, ...]]:
        """``draft_forward``: each step's slots in ``out_cache_loc``, its backend's layer run on the round."""
        rows, layer = CAPTURED * self.topk, self.layer
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        per_step = batch.out_cache_loc.view(rows, self.steps)
        generator = torch.Generator().manual_seed(seed)
        ran = []
        for step, child in enumerate(self.container.attn_backends):
            q, k, v = (torch.randn(rows, h * dim, generator=generator) for h in (heads, kv_heads, kv_heads))
            k, v = k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
            batch.out_cache_loc = per_step[:, step]
            with torch.no_grad(), forward_context(ForwardContext(attn_backend=child)):
                out = child.forward(q, k, v, layer, batch).as_subclass(torch.Tensor)
            ran.append((q, k, v, out.view(rows, heads, dim)))
        batch.out_cache_loc = per_step.view(-1)
        return ran

    def capture(self) -> None:
        self.captured = self._round(lambda t: t)
        self.container.init_forward_metadata_out_graph(self.captured, in_capture=True)
        self.container.init_forward_metadata_in_graph(self.captured)
        self._steps(self.captured, 0)  # the warm-up run before capture

    def replay(self, live: int, seed: int) -> None:
        fixture, topk, steps = self.fixture, self.topk, self.steps
        table = fixture.runner.req_to_token_pool.req_to_token
        requests = fixture.forward_batch.req_pool_indices
        self.seq_lens.fill_(self.fill)
        self.rows.zero_()
        self.loc.zero_()
        self.seq_lens[:live] = torch.tensor(PREFIX[:live])
        self.rows[:live] = requests[:live]
        prefixes = {int(slot) for b in range(CAPTURED) for slot in table[int(requests[b]), : PREFIX[b]]}
        free = torch.tensor([slot for slot in range(1, self.caches[0].shape[0]) if slot not in prefixes])
        order = torch.randperm(free.numel(), generator=torch.Generator().manual_seed(seed))
        slots = free[order[: live * topk * steps]]  # scattered, never a prefix's slot nor slot 0
        self.loc[: slots.numel()] = slots
        before = tuple(cache.clone() for cache in self.caches)
        batch = self._round(device_only)
        with no_host_reads():
            self.container.init_forward_metadata_out_graph(batch)
            ran = self._steps(batch, seed)
        written = set(self.loc[: slots.numel()].tolist())
        for cache, old in zip(self.caches, before, strict=True):
            assert _changed_slots(cache, old) <= {*written, 0}, "a padded row wrote a live slot"
        self._check(ran, live, table, requests)

    def _check(self, ran: list[tuple[torch.Tensor, ...]], live: int, table: torch.Tensor, requests: Any) -> None:
        """Each live branch row's step attends to its request's prefix and its own branch's tokens so far."""
        layer, topk = self.layer, self.topk
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        keys_all, values_all = self.caches
        per_row = self.loc.view(CAPTURED * topk, self.steps)
        for step, (q, k, v, out) in enumerate(ran):
            written = per_row[: live * topk, step]
            assert torch.equal(keys_all[written], k[: live * topk]), f"step {step}: K not at the step's slots"
            assert torch.equal(values_all[written], v[: live * topk]), f"step {step}: V not at the step's slots"
            for row in range(live * topk):
                b = row // topk
                slots = torch.cat([table[int(requests[b]), : PREFIX[b]].long(), per_row[row, : step + 1]])
                keys = keys_all[slots].double().repeat_interleave(heads // kv_heads, dim=1)
                values = values_all[slots].double().repeat_interleave(heads // kv_heads, dim=1)
                scores = torch.einsum("hd,shd->hs", q.view(-1, heads, dim)[row].double(), keys) * layer.scaling
                expected = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
                torch.testing.assert_close(
                    out[row].double(), expected, atol=2e-5, rtol=2e-5, msg=f"step {step}, row {row}"
                )
            assert bool(torch.isfinite(out).all()), f"step {step}: a padded row's output is not finite"


def _draft_storage(container: SGLangMultiStepDraftBackend) -> dict[str, int]:
    graphs = container._graphs
    assert graphs is not None
    return {
        name: tensor.data_ptr()
        for name, tensor in (
            ("table", graphs.rows.table),
            ("prefix_lens", graphs.prefix_lens),
            ("seq_lens", graphs.seq_lens),
            ("step_slots", graphs.step_slots),
        )
    }


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_draft_decode_replays_with_padding_attend_to_the_prefix_and_their_own_branch(backend: str, topk: int) -> None:
    runner = _DraftRunner(backend, topk, steps=3)
    runner.capture()
    planned = [child._batch for child in runner.container.attn_backends]
    tables = [child.kv_view.slot_table for child in runner.container.attn_backends]
    storage = _draft_storage(runner.container)
    for seed, live in enumerate(LIVE, start=1):
        runner.replay(live, seed)
        assert [child._batch for child in runner.container.attn_backends] == planned, "a step planned a new batch"
        assert all(a is b for a, b in zip(planned, [c._batch for c in runner.container.attn_backends], strict=True))
        assert all(
            child.kv_view.slot_table is table
            for child, table in zip(runner.container.attn_backends, tables, strict=True)
        ), "a step reads another slot table than at capture"
        assert _draft_storage(runner.container) == storage, "a tensor the captured steps read moved"


def test_draft_graphs_for_a_backend_without_graph_support_are_refused_when_the_runner_starts() -> None:
    _, container = _draft_container("attnhost_torch_native", 2, 3)
    with pytest.raises(UnsupportedFeatureError, match=r"'torch_native'.*graph capture.*--disable-cuda-graph"):
        container.init_cuda_graph_state(CAPTURED, CAPTURED * 2)
