"""SGLang's decode graphs through the adapter, driven in the order SGLang's graph runners call it, on CPU tensors.

``DecodeCudaGraphRunner``: ``init_cuda_graph_state(max_bs)`` once; at capture of size ``N`` the batch of its static
buffers (every row padding: request row 0, length ``get_cuda_graph_seq_len_fill_value()``, slot 0) through
``init_forward_metadata_out_graph(in_capture=True)``, ``init_forward_metadata_in_graph`` and the layers; before each
replay the buffers refilled with ``1..N`` live requests (the rest padding) and a replay view whose ``out_cache_loc``
holds the live rows' slots only, through ``init_forward_metadata_out_graph``. ``CPUGraphRunner``: the same with
``init_cpu_graph_state``, ``init_forward_metadata_capture_cpu_graph`` and ``init_forward_metadata`` on the padded
captured batch. At every replay, with SGLang's tensors refusing host reads: the live rows equal float64 attention
over their requests' keys, the padded rows write nowhere but slot 0, and every tensor the captured layers read
(the adapter's graph batch, the backend's plan) is the one of the capture, in the same storage. A backend without
graph support is refused by name when the runner starts. A page table a backend built from the graph batch is
refreshed in place with the rest.
"""

from __future__ import annotations

import unittest
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    build_dense_attention_fixture,
)

from attnhost import UnsupportedFeatureError  # noqa: E402
from attnhost.testing.host_reads import device_only, no_host_reads  # noqa: E402

PREFIX = (9, 4, 13, 6)
CAPTURED = 4


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _fixture(backend: str) -> Any:
    case = DenseAttentionCase(
        name="graph_decode",
        backend=backend,
        forward_mode=ForwardMode.DECODE,
        num_heads=8,
        num_kv_heads=2,
        page_size=1,
        prefix_lens=PREFIX,
        extend_lens=(),
    )
    with torch.no_grad():
        return build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)


def _storage(adapter: Any) -> dict[str, int]:
    """Where every tensor a captured graph reads lives: the adapter's graph buffers and the backend's plan."""
    graphs = adapter._graphs.decode
    found = {
        name: getattr(graphs, name).data_ptr()
        for name in ("seq_lens", "prefix_lens", "extend_lens", "rows", "out_cache_loc")
    }
    meta = adapter.attnhost_backend._metadata
    found["query_valid"] = meta.query_valid.data_ptr()
    found["query_rows"] = meta.query_rows.data_ptr()
    for kind, keys in meta.kinds.items():
        found[f"key_slots{kind}"] = keys.key_slots.data_ptr()
        found[f"blocked{kind}"] = keys.blocked.data_ptr()
    return found


class _Runner:
    """SGLang's static input buffers of one captured size and the steps a graph runner takes with them."""

    def __init__(self, fixture: Any, cpu: bool, refuse_reads: bool = True) -> None:
        """``refuse_reads``: SGLang's tensors as :class:`DeviceOnly` (plain for ``torch.compile``, which does not
        trace through a ``__torch_function__`` subclass)."""
        self.fixture, self.cpu = fixture, cpu
        self.on_device = device_only if refuse_reads else _plain
        self.adapter, self.layer = fixture.backend, fixture.actual_module.attn
        if cpu:
            self.adapter.init_cpu_graph_state(CAPTURED, CAPTURED)
            self.fill = self.adapter.get_cpu_graph_seq_len_fill_value()
        else:
            self.adapter.init_cuda_graph_state(CAPTURED, CAPTURED)
            self.fill = self.adapter.get_cuda_graph_seq_len_fill_value()
        # SGLang's static input buffers, on its "device": refilled in place before every replay
        self.seq_lens = self.on_device(torch.full((CAPTURED,), self.fill, dtype=torch.int64))
        self.rows = self.on_device(torch.zeros(CAPTURED, dtype=torch.int64))
        self.loc = self.on_device(torch.zeros(CAPTURED, dtype=torch.int64))
        self.captured = self._view(self.loc)  # CPUGraphRunner keeps this batch object for every replay
        pool = fixture.runner.token_to_kv_pool
        self.k_cache, self.v_cache = (
            pool.get_key_buffer(self.layer.layer_id),
            pool.get_value_buffer(self.layer.layer_id),
        )

    compiled: Any = None
    """Set to run the layer compiled (as CPUGraphRunner does, ``torch.compile`` of the forward)."""

    def _view(self, loc: torch.Tensor) -> SimpleNamespace:
        """A batch as SGLang's graph runners hand it: the captured batch, or a replay view (lengths only on the
        device, no host copy, and the fields of SGLang's ``ForwardBatch`` the adapter reads)."""
        return SimpleNamespace(
            batch_size=CAPTURED,
            forward_mode=ForwardMode.DECODE,
            seq_lens=self.seq_lens,
            seq_lens_cpu=None,
            req_pool_indices=self.rows,
            out_cache_loc=loc,
            spec_info=None,
            encoder_lens=None,
        )

    def capture(self) -> None:
        if self.cpu:
            self.adapter.init_forward_metadata_capture_cpu_graph(
                CAPTURED, CAPTURED, self.rows, self.seq_lens, self.loc, None, ForwardMode.DECODE, None
            )
        else:
            self.adapter.init_forward_metadata_out_graph(self.captured, in_capture=True)
            self.adapter.init_forward_metadata_in_graph(self.captured)
        self.forward(self.captured, *self.inputs(0))  # the warm-up run before capture

    def inputs(self, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads, kv_heads, dim = self.layer.tp_q_head_num, self.layer.tp_k_head_num, self.layer.qk_head_dim
        generator = torch.Generator().manual_seed(seed)
        return (
            torch.randn(CAPTURED, heads * dim, generator=generator),
            torch.randn(CAPTURED, kv_heads, dim, generator=generator),
            torch.randn(CAPTURED, kv_heads, dim, generator=generator),
        )

    def forward(self, batch: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = self.adapter.forward(q, k, v, self.layer, batch)
        return out

    def replay(self, live: int, seed: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Refill the buffers with ``live`` requests, each one new token (the rest padding), prepare and run."""
        fixture = self.fixture
        table = fixture.runner.req_to_token_pool.req_to_token
        batch = fixture.forward_batch
        free = table.numel() // 2 + 16 * seed
        slots = [free + i for i in range(live)]
        self.seq_lens.fill_(self.fill)
        self.rows.zero_()
        self.loc.zero_()
        for i in range(live):
            row = int(batch.req_pool_indices[i])
            table[row, PREFIX[i] + seed] = slots[i]  # the scheduler records the new token's slot before the step
            self.seq_lens[i] = PREFIX[i] + seed + 1
            self.rows[i] = row
            self.loc[i] = slots[i]
        before = (self.k_cache.clone(), self.v_cache.clone())
        q, k, v = self.inputs(seed)
        with no_host_reads():
            if self.cpu:  # CPUGraphRunner.prepare_replay: init_forward_metadata on the padded captured batch
                self.adapter.init_forward_metadata(self.captured)
                run_on = self.captured
            else:  # a new replay view: the static lengths and rows, the live rows' slots only
                run_on = self._view(self.on_device(torch.tensor(slots, dtype=torch.int64)))
                self.adapter.init_forward_metadata_out_graph(run_on)
            out = (self.compiled or self.forward)(run_on, *(self.on_device(t) for t in (q, k, v)))
        self._check_cache(before, slots, k, v, live)
        return out.as_subclass(torch.Tensor), slots, q

    def _check_cache(
        self, before: tuple[torch.Tensor, torch.Tensor], slots: list[int], k: Any, v: Any, live: int
    ) -> None:
        for cache, old, new in ((self.k_cache, before[0], k), (self.v_cache, before[1], v)):
            assert torch.equal(cache[slots], new[:live]), "a live row's K/V is not at its slot"
            changed = (cache != old).flatten(1).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) <= {*slots, 0}, f"padded rows wrote live slots {sorted(set(changed) - {*slots, 0})}"


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _reference(runner: _Runner, q: torch.Tensor, live: int, seed: int) -> torch.Tensor:
    """Float64 attention of each live row over its request's keys, the new one included."""
    fixture, layer = runner.fixture, runner.layer
    table, batch = fixture.runner.req_to_token_pool.req_to_token, fixture.forward_batch
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    rows = []
    for i in range(live):
        slots = table[int(batch.req_pool_indices[i]), : PREFIX[i] + seed + 1].long()
        keys = runner.k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = runner.v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", q.view(-1, heads, dim)[i].double(), keys) * layer.scaling
        rows.append(torch.einsum("hs,shd->hd", scores.softmax(-1), values))
    return torch.stack(rows)


@pytest.mark.parametrize("runner_kind", ["cuda", "cpu"])
def test_replays_with_padding_are_right_write_nothing_live_and_keep_their_storage(runner_kind: str) -> None:
    runner = _Runner(_fixture("batched_matmul"), cpu=runner_kind == "cpu")
    assert runner.fill == 1
    runner.capture()
    planned = runner.adapter._batch
    storage = _storage(runner.adapter)
    page_table = planned.page_table  # what a backend that reads the page table sees, built at capture
    table = runner.fixture.runner.req_to_token_pool.req_to_token
    for seed, live in enumerate((3, 1, 4, 2), start=1):
        out, _, q = runner.replay(live, seed)
        assert planned.page_table is page_table, "the graph batch's page table is another tensor than at capture"
        rows = runner.rows.as_subclass(torch.Tensor)
        fresh = table.index_select(0, rows)[:, : page_table.shape[1]].to(torch.int64)
        assert torch.equal(page_table.as_subclass(torch.Tensor), fresh), "the page table is not this step's"
        heads, dim = runner.layer.tp_q_head_num, runner.layer.qk_head_dim
        expected = _reference(runner, q, live, seed)
        torch.testing.assert_close(out.view(CAPTURED, heads, dim)[:live].double(), expected, atol=2e-5, rtol=2e-5)
        assert bool(torch.isfinite(out).all()), "a padded row's output is not finite"
        assert runner.adapter._batch is planned, "the replay planned another batch than the captured one"
        assert _storage(runner.adapter) == storage, "a tensor the captured layers read moved"


def test_the_captured_step_compiles_whole_and_replays_without_recompiling() -> None:
    """CPUGraphRunner's ``torch.compile`` of the forward: the adapter's and the backend's layer code traced as one
    graph (``fullgraph=True``: no graph break), compiled once, and every replay runs that graph on the refreshed
    buffers (no recompilation, which guards on a moved or replaced tensor would force), right for its live rows."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    runner = _Runner(_fixture("batched_matmul"), cpu=True, refuse_reads=False)
    runner.capture()
    counter = CompileCounter()
    runner.compiled = torch.compile(runner.forward, backend=counter, fullgraph=True, dynamic=False)
    heads, dim = runner.layer.tp_q_head_num, runner.layer.qk_head_dim
    for seed, live in enumerate((3, 1, 4, 2), start=1):
        out, _, q = runner.replay(live, seed)
        expected = _reference(runner, q, live, seed)
        torch.testing.assert_close(out.view(CAPTURED, heads, dim)[:live].double(), expected, atol=2e-5, rtol=2e-5)
    assert counter.frame_count == 1, f"the step was compiled {counter.frame_count} times, not once"
    torch._dynamo.reset()


def test_a_backend_without_graph_support_is_refused_when_the_runner_starts() -> None:
    adapter = _fixture("attnhost_torch_native").backend
    for start in (adapter.init_cuda_graph_state, adapter.init_cpu_graph_state):
        with pytest.raises(UnsupportedFeatureError, match=r"'torch_native'.*graph capture.*--disable-cuda-graph"):
            start(CAPTURED, CAPTURED)
    with pytest.raises(UnsupportedFeatureError, match="graph capture"):
        adapter.get_cuda_graph_seq_len_fill_value()


def test_a_graph_of_a_mode_the_adapter_does_not_capture_is_refused_by_name() -> None:
    adapter = _fixture("batched_matmul").backend
    adapter.init_cuda_graph_state(CAPTURED, CAPTURED)
    view = SimpleNamespace(batch_size=2, forward_mode=ForwardMode.DRAFT_EXTEND_V2)
    with pytest.raises(UnsupportedFeatureError, match=r"DRAFT_EXTEND_V2 graphs.*--disable-cuda-graph"):
        adapter.init_forward_metadata_out_graph(view, in_capture=True)
