"""torch_native against the float64 reference, plus the KV pool and ForwardBatch contracts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import pytest

torch = pytest.importorskip("torch")  # the py312/py313 envs have no torch
pytestmark = pytest.mark.torch

import attnhost_builtin.torch_native as torch_native
from attnhost.backend import AttentionBackend, AttentionLayer
from attnhost.errors import KVPoolFullError
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.kv_pool import KVPool
from attnhost.testing.reference import reference_attention, tree_mask
from attnhost_builtin.torch_native import TorchNativeAttnBackend

HEAD_DIM = 16
F32_TOL = 1e-5
BF16_TOL = 2e-2


def make_pool(
    num_kv_heads: int = 2,
    *,
    num_layers: int = 2,
    num_slots: int = 512,
    dtype: torch.dtype = torch.float32,
) -> KVPool:
    return KVPool(
        num_layers,
        num_slots,
        num_kv_heads,
        HEAD_DIM,
        max_requests=8,
        max_context_len=300,
        dtype=dtype,
    )


def new_tokens(
    batch: ForwardBatch, layer: AttentionLayer, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = batch.num_new_tokens
    q = torch.randn(n, layer.num_heads, layer.head_dim).to(dtype)
    k = torch.randn(n, layer.num_kv_heads, layer.head_dim).to(dtype)
    v = torch.randn(n, layer.num_kv_heads, layer.head_dim).to(dtype)
    return q, k, v


def run(
    backend: TorchNativeAttnBackend,
    pool: KVPool,
    mode: ForwardMode,
    requests: Sequence[tuple[int, int, int]],
    layer: AttentionLayer,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """One forward of one layer through the backend; returns (output, q, batch)."""
    batch = ForwardBatch.prepare(pool, mode, requests)
    backend.init_forward_metadata(batch)
    q, k, v = new_tokens(batch, layer, dtype)
    return backend.forward(q, k, v, layer, batch), q, batch


def max_error(out: torch.Tensor, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> float:
    ref = reference_attention(q, layer, batch)
    assert out.shape == ref.shape
    return float((out.to(torch.float64) - ref).abs().max())


def alloc(pool: KVPool, n: int) -> list[int]:
    return [pool.alloc_request() for _ in range(n)]


# -- correctness against the reference ------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
def test_extend_without_prefix(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    pool = make_pool(kv_heads)
    layer = AttentionLayer(0, heads, kv_heads, HEAD_DIM)
    (r,) = alloc(pool, 1)
    out, q, batch = run(TorchNativeAttnBackend(), pool, ForwardMode.EXTEND, [(r, 0, 37)], layer)
    assert out.shape == (37, heads, HEAD_DIM)
    assert max_error(out, q, layer, batch) < F32_TOL


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
def test_extend_with_prefix_written_by_backend(heads: int, kv_heads: int) -> None:
    torch.manual_seed(1)
    pool = make_pool(kv_heads)
    layer = AttentionLayer(1, heads, kv_heads, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    r1, r2 = alloc(pool, 2)
    run(backend, pool, ForwardMode.EXTEND, [(r1, 0, 20), (r2, 0, 9)], layer)
    out, q, batch = run(backend, pool, ForwardMode.EXTEND, [(r1, 20, 11), (r2, 9, 5)], layer)
    assert max_error(out, q, layer, batch) < F32_TOL


def test_extend_with_prefix_written_directly() -> None:
    torch.manual_seed(2)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    (r,) = alloc(pool, 1)
    prefix_slots = pool.alloc_slots(17).flip(0)  # deliberately not one ascending run
    pool.req_to_token[r, :17] = prefix_slots
    pool.set_kv(0, prefix_slots, torch.randn(17, 2, HEAD_DIM), torch.randn(17, 2, HEAD_DIM))
    out, q, batch = run(TorchNativeAttnBackend(), pool, ForwardMode.EXTEND, [(r, 17, 6)], layer)
    assert max_error(out, q, layer, batch) < F32_TOL


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
def test_decode_after_prefill(heads: int, kv_heads: int) -> None:
    torch.manual_seed(3)
    pool = make_pool(kv_heads)
    layer = AttentionLayer(0, heads, kv_heads, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    reqs = alloc(pool, 3)
    lens = [13, 1, 40]
    run(backend, pool, ForwardMode.EXTEND, [(r, 0, n) for r, n in zip(reqs, lens, strict=True)], layer)
    for step in range(3):  # later steps read fragmented slots through a gather
        decode = [(r, n + step, 1) for r, n in zip(reqs, lens, strict=True)]
        out, q, batch = run(backend, pool, ForwardMode.DECODE, decode, layer)
        assert out.shape == (3, heads, HEAD_DIM)
        assert max_error(out, q, layer, batch) < F32_TOL


@pytest.fixture
def torch_threads() -> Iterator[Callable[[int], None]]:
    """Set torch's thread count for one test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("lens", [[5, 40, 40, 17, 1, 33], [20, 20, 20, 20]])
@pytest.mark.parametrize("chunk_rows", [1 << 16, 64, 1])
def test_decode_in_chunks(
    monkeypatch: pytest.MonkeyPatch, torch_threads: Callable[[int], None], lens: list[int], chunk_rows: int
) -> None:
    """Decode sorts requests by length into padded chunks: one chunk, several, or a request each (on two threads,
    whatever the run's own count, so the chunks are the head-major ones)."""
    torch_threads(2)
    row_bytes = 2 * HEAD_DIM * 4  # a float32 cache row: 2 KV heads
    monkeypatch.setattr(torch_native, "_DECODE_CHUNK_BYTES", 2 * chunk_rows * row_bytes)
    torch.manual_seed(11)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    reqs = alloc(pool, len(lens))
    for r, n in zip(reqs, lens, strict=True):  # one request at a time: each request's slots are one run
        run(backend, pool, ForwardMode.EXTEND, [(r, 0, n)], layer)
    for step in range(2):  # the second step reads slots that are no longer one run
        decode = [(r, n + step, 1) for r, n in zip(reqs, lens, strict=True)]
        out, q, batch = run(backend, pool, ForwardMode.DECODE, decode, layer)
        chunks, _ = backend._plan.chunks[2, row_bytes, True, -1]  # type: ignore[union-attr]
        expected_chunks = {1 << 16: 1, 64: None, 1: len(lens)}[chunk_rows]
        assert expected_chunks is None or len(chunks) == expected_chunks
        assert sum(chunk.count for chunk in chunks) == len(lens)
        assert max_error(out, q, layer, batch) < F32_TOL


class _HeadSlicedCache:
    """A KV cache whose buffers are the first heads of wider tensors: strided views with no flat row view."""

    def __init__(self, pool: KVPool, kv_heads: int) -> None:
        self.pool, self.kv_heads = pool, kv_heads
        self.device, self.dtype, self.req_to_token = pool.device, pool.dtype, pool.req_to_token
        self.page_size = 1

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self.pool.k_buffer(layer_id)[:, : self.kv_heads]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self.pool.v_buffer(layer_id)[:, : self.kv_heads]

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self.k_buffer(layer_id).index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer(layer_id).index_copy_(0, loc, v.to(self.dtype))


@pytest.mark.parametrize(("threads", "sliced"), [(2, False), (2, True), (1, False)])
@pytest.mark.parametrize("lens", [[70], [70, 9, 33]])
def test_decode_gathers_lone_requests_head_major(
    monkeypatch: pytest.MonkeyPatch, torch_threads: Callable[[int], None], lens: list[int], threads: int, sliced: bool
) -> None:
    """On several threads a chunk of one request gathers head-major rows, unless the cache's strides allow no
    such view; on one thread it stays token-major."""
    torch_threads(threads)
    monkeypatch.setattr(torch_native, "_DECODE_CHUNK_BYTES", 1)  # a request per chunk
    torch.manual_seed(12)
    pool = make_pool(4 if sliced else 2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    backend = TorchNativeAttnBackend()

    def step(mode: ForwardMode, requests: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
        batch = ForwardBatch.prepare(pool, mode, requests)
        if sliced:
            batch = dataclasses.replace(batch, kv_pool=_HeadSlicedCache(pool, 2))
        backend.init_forward_metadata(batch)
        q, k, v = new_tokens(batch, layer)
        return backend.forward(q, k, v, layer, batch), q

    reqs = alloc(pool, len(lens))
    for r, n in zip(reqs, lens, strict=True):
        step(ForwardMode.EXTEND, [(r, 0, n)])
    pool.req_to_token[reqs[0], : lens[0]] = pool.req_to_token[reqs[0], : lens[0]].flip(0)  # fragmented
    out, q = step(ForwardMode.DECODE, [(r, n, 1) for r, n in zip(reqs, lens, strict=True)])
    plan = backend._plan
    assert plan is not None
    head_major = threads > 1 and not sliced
    chunks, _ = plan.chunks[2, 2 * HEAD_DIM * 4, head_major, -1]
    assert [chunk.head_major for chunk in chunks] == [head_major] * len(lens)
    assert max_error(out, q, layer, plan.batch) < F32_TOL


def test_mixed_batch_of_different_lengths() -> None:
    torch.manual_seed(4)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    reqs = alloc(pool, 4)
    run(backend, pool, ForwardMode.EXTEND, [(reqs[0], 0, 30), (reqs[1], 0, 3)], layer)
    batch_spec = [(reqs[0], 30, 1), (reqs[1], 3, 12), (reqs[2], 0, 25), (reqs[3], 0, 1)]
    out, q, batch = run(backend, pool, ForwardMode.MIXED, batch_spec, layer)
    assert out.shape == (39, 8, HEAD_DIM)
    assert max_error(out, q, layer, batch) < F32_TOL


def test_long_prefill_uses_causal_path_correctly() -> None:
    """Prefix-free requests of >= 256 tokens take SDPA's is_causal branch."""
    torch.manual_seed(5)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    reqs = alloc(pool, 2)
    out, q, batch = run(TorchNativeAttnBackend(), pool, ForwardMode.EXTEND, [(reqs[0], 0, 260), (reqs[1], 0, 5)], layer)
    assert max_error(out, q, layer, batch) < F32_TOL


def test_unfolded_gqa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the folded mask would be too large the backend uses enable_gqa instead."""
    monkeypatch.setattr(torch_native, "_MAX_FOLDED_MASK", 1)
    torch.manual_seed(6)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    (r,) = alloc(pool, 1)
    run(backend, pool, ForwardMode.EXTEND, [(r, 0, 10)], layer)
    out, q, batch = run(backend, pool, ForwardMode.EXTEND, [(r, 10, 7)], layer)
    assert max_error(out, q, layer, batch) < F32_TOL


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_bfloat16(kv_heads: int) -> None:
    torch.manual_seed(7)
    pool = make_pool(kv_heads, dtype=torch.bfloat16)
    layer = AttentionLayer(0, 4, kv_heads, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    reqs = alloc(pool, 2)
    out, q, batch = run(backend, pool, ForwardMode.EXTEND, [(reqs[0], 0, 24), (reqs[1], 0, 7)], layer, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert max_error(out, q, layer, batch) < BF16_TOL
    out, q, batch = run(backend, pool, ForwardMode.DECODE, [(reqs[0], 24, 1), (reqs[1], 7, 1)], layer, torch.bfloat16)
    assert max_error(out, q, layer, batch) < BF16_TOL


def test_comparison_detects_a_small_perturbation() -> None:
    """A 0.1 % error in the output must fail the float32 tolerance."""
    torch.manual_seed(8)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    (r,) = alloc(pool, 1)
    out, q, batch = run(TorchNativeAttnBackend(), pool, ForwardMode.EXTEND, [(r, 0, 16)], layer)
    assert max_error(out, q, layer, batch) < F32_TOL
    assert max_error(out * 1.001, q, layer, batch) > F32_TOL


def test_custom_scaling_is_used() -> None:
    torch.manual_seed(9)
    pool = make_pool(2)
    layer = AttentionLayer(0, 4, 2, HEAD_DIM, scaling=0.5)
    (r,) = alloc(pool, 1)
    out, q, batch = run(TorchNativeAttnBackend(), pool, ForwardMode.EXTEND, [(r, 0, 9)], layer)
    assert max_error(out, q, layer, batch) < F32_TOL
    default = AttentionLayer(0, 4, 2, HEAD_DIM)
    assert max_error(out, q, default, batch) > F32_TOL


# -- the cache --------------------------------------------------------------


def test_new_kv_lands_only_in_out_cache_loc_of_its_layer() -> None:
    torch.manual_seed(10)
    pool = make_pool(2, num_layers=3, num_slots=64)
    for layer_id in range(3):  # non-zero background so overwrites are visible
        pool.k_buffer(layer_id).normal_()
        pool.v_buffer(layer_id).normal_()
    before = [(pool.k_buffer(i).clone(), pool.v_buffer(i).clone()) for i in range(3)]
    layer = AttentionLayer(1, 4, 2, HEAD_DIM)
    reqs = alloc(pool, 2)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(reqs[0], 0, 5), (reqs[1], 0, 3)])
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    q, k, v = new_tokens(batch, layer)
    backend.forward(q, k, v, layer, batch)

    loc = batch.out_cache_loc
    assert torch.equal(pool.k_buffer(1)[loc], k)
    assert torch.equal(pool.v_buffer(1)[loc], v)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(pool.k_buffer(1)[untouched], before[1][0][untouched])
    assert torch.equal(pool.v_buffer(1)[untouched], before[1][1][untouched])
    for other in (0, 2):
        assert torch.equal(pool.k_buffer(other), before[other][0])
        assert torch.equal(pool.v_buffer(other), before[other][1])


def test_save_kv_cache_false_reads_what_the_caller_wrote() -> None:
    torch.manual_seed(11)
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    (r,) = alloc(pool, 1)
    run(backend, pool, ForwardMode.EXTEND, [(r, 0, 12)], layer)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 12, 4)])
    backend.init_forward_metadata(batch)
    q, k, v = new_tokens(batch, layer)
    pool.set_kv(0, batch.out_cache_loc, k, v)
    snapshot = pool.k_buffer(0).clone()
    # The k/v arguments are garbage: the backend must neither store nor use them.
    out = backend.forward(q, k * 100, v * 100, layer, batch, save_kv_cache=False)
    assert torch.equal(pool.k_buffer(0), snapshot)
    assert max_error(out, q, layer, batch) < F32_TOL


def test_kv_pool_allocation_is_deterministic_and_bounded() -> None:
    pool = make_pool(num_slots=10)
    a = pool.alloc_slots(4)
    b = pool.alloc_slots(3)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6]
    pool.free_slots(a[:2])
    assert pool.alloc_slots(5).tolist() == [7, 8, 9, 0, 1]
    with pytest.raises(KVPoolFullError, match="KV pool is full"):
        pool.alloc_slots(1)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_slots(torch.tensor([2, 2]))
    pool.free_slots(torch.tensor([2]))
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_slots(torch.tensor([2]))
    assert isinstance(KVPoolFullError("x"), RuntimeError)


def test_request_slots_are_deterministic_and_bounded() -> None:
    pool = make_pool()
    assert alloc(pool, 8) == list(range(8))
    with pytest.raises(KVPoolFullError, match="no free request slot"):
        pool.alloc_request()
    pool.free_request(5)
    pool.free_request(2)
    assert pool.alloc_request() == 5
    with pytest.raises(ValueError, match="not allocated"):
        pool.free_request(2)


def test_prepare_records_slots_in_req_to_token() -> None:
    pool = make_pool()
    reqs = alloc(pool, 2)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(reqs[0], 0, 3), (reqs[1], 4, 2)])
    assert batch.out_cache_loc.tolist() == [0, 1, 2, 3, 4]
    assert pool.req_to_token[reqs[0], :3].tolist() == [0, 1, 2]
    assert pool.req_to_token[reqs[1], 4:6].tolist() == [3, 4]
    assert batch.seq_lens_cpu == (3, 6) and batch.prefix_lens_cpu == (0, 4)
    assert batch.extend_seq_lens_cpu == (3, 2) and batch.extend_start_loc_cpu == (0, 3)
    assert batch.batch_size == 2 and batch.num_new_tokens == 5
    assert batch.seq_lens.tolist() == [3, 6] and batch.extend_seq_lens.dtype == torch.int64


# -- routing and validation -----------------------------------------------


def test_idle_forward_returns_empty() -> None:
    pool = make_pool(2)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    batch = ForwardBatch.prepare(pool, ForwardMode.IDLE, [])
    assert batch.batch_size == 0 and batch.num_new_tokens == 0
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    q, k, v = new_tokens(batch, layer)
    out = backend.forward(q, k, v, layer, batch)
    assert out.shape == (0, 8, HEAD_DIM)


class _Spy(TorchNativeAttnBackend):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def forward_extend(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls.append("extend")
        return torch.empty(0)

    def forward_decode(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls.append("decode")
        return torch.empty(0)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (ForwardMode.DECODE, "decode"),
        (ForwardMode.EXTEND, "extend"),
        (ForwardMode.MIXED, "extend"),
        (ForwardMode.TARGET_VERIFY, "extend"),
        (ForwardMode.DRAFT_EXTEND, "extend"),
        (ForwardMode.DRAFT_EXTEND_V2, "extend"),
    ],
)
def test_forward_routes_by_mode(mode: ForwardMode, expected: str) -> None:
    pool = make_pool(2)
    layer = AttentionLayer(0, 4, 2, HEAD_DIM)
    (r,) = alloc(pool, 1)
    batch = ForwardBatch.prepare(pool, mode, [(r, 3, 1)])
    spy = _Spy()
    q, k, v = new_tokens(batch, layer)
    spy.forward(q, k, v, layer, batch)
    assert spy.calls == [expected]
    assert isinstance(spy, AttentionBackend)


def test_forward_without_metadata_is_refused() -> None:
    pool = make_pool(2)
    layer = AttentionLayer(0, 4, 2, HEAD_DIM)
    reqs = alloc(pool, 1)
    backend = TorchNativeAttnBackend()
    stale = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(reqs[0], 0, 2)])
    backend.init_forward_metadata(stale)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(reqs[0], 2, 2)])
    q, k, v = new_tokens(batch, layer)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, v, layer, batch)


@pytest.mark.parametrize(
    ("mode", "requests", "message"),
    [
        (ForwardMode.DECODE, [(0, 4, 2)], "exactly one new token"),
        (ForwardMode.IDLE, [(0, 0, 1)], "IDLE batch takes no requests"),
        (ForwardMode.EXTEND, [], "needs requests"),
        (ForwardMode.EXTEND, [(0, 290, 11)], "exceeds max_context_len=300"),
        (ForwardMode.EXTEND, [(0, -1, 2)], "prefix_len >= 0"),
        (ForwardMode.EXTEND, [(0, 0, 0)], "extend_len >= 1"),
        (ForwardMode.EXTEND, [(8, 0, 1)], "out of range"),
        (ForwardMode.EXTEND, [(1, 0, 1)], "not allocated"),
        (ForwardMode.EXTEND, [(0, 0, 1), (0, 1, 1)], "twice"),
        (ForwardMode.EXTEND, [(0, 0, 1, 5)], "is not"),
    ],
)
def test_prepare_validation(mode: ForwardMode, requests: list[tuple[int, int, int]], message: str) -> None:
    pool = make_pool()
    pool.alloc_request()
    with pytest.raises(ValueError, match=message):
        ForwardBatch.prepare(pool, mode, requests)
    assert pool.available_slots == pool.num_slots  # nothing was allocated


def test_prepare_refuses_more_slots_than_free() -> None:
    pool = make_pool(num_slots=10)
    (r,) = alloc(pool, 1)
    with pytest.raises(KVPoolFullError, match="needs 11 token slots"):
        ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 0, 11)])
    assert pool.available_slots == 10


# -- speculative trees (ForwardBatch.tree_mask) ----------------------------------------


def test_tree_verify_by_hand() -> None:
    """Zero queries weigh every visible key alike, so each output is the mean of the values it may see."""
    pool = make_pool(1, num_layers=1)
    layer = AttentionLayer(0, 2, 1, HEAD_DIM)
    (r,) = alloc(pool, 1)
    prefill = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 0, 2)])
    values = torch.arange(5.0).view(5, 1, 1).expand(5, 1, HEAD_DIM)  # token at position p has value p
    pool.set_kv(0, prefill.out_cache_loc, torch.zeros(2, 1, HEAD_DIM), values[:2])
    # new tokens 0, 1, 2 at positions 2, 3, 4; tokens 1 and 2 are both children of token 0 (topk 2)
    batch = ForwardBatch.prepare(pool, ForwardMode.TARGET_VERIFY, [(r, 2, 3)], tree_mask=tree_mask([-1, 0, 0]))
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    q = torch.zeros(3, 2, HEAD_DIM)
    out = backend.forward(q, torch.zeros(3, 1, HEAD_DIM), values[2:].clone(), layer, batch)
    # token 0 sees positions 0-2, token 1 sees 0-3, token 2 sees 0, 1, 2 and itself (4) but not its sibling (3)
    expected = torch.tensor([(0 + 1 + 2) / 3, (0 + 1 + 2 + 3) / 4, (0 + 1 + 2 + 4) / 4])
    assert torch.allclose(out[:, :, 0], expected.view(3, 1).expand(3, 2), atol=1e-6), out[:, :, 0]
    assert torch.allclose(reference_attention(q, layer, batch)[:, :, 0].float(), out[:, :, 0], atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tree_verify_matches_the_reference(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    pool = make_pool(kv_heads, dtype=dtype)
    layer = AttentionLayer(0, heads, kv_heads, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    reqs = alloc(pool, 4)
    run(backend, pool, ForwardMode.EXTEND, [(reqs[0], 0, 13), (reqs[1], 0, 1), (reqs[2], 0, 30)], layer, dtype)
    scattered = pool.alloc_slots(9).flip(0)  # a fragmented prefix: the gather path
    pool.req_to_token[reqs[3], :9] = scattered
    pool.set_kv(0, scattered, torch.randn(9, kv_heads, HEAD_DIM), torch.randn(9, kv_heads, HEAD_DIM))
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    cases = [
        ([(reqs[0], 13, 6), (reqs[1], 1, 6), (reqs[3], 9, 6)], [[-1, 0, 0, 1, 2, 1], [-1, 0, 1, 0, 2, 4]] * 2),
        ([(reqs[2], 30, 8)], [[-1, 0, 0, 0, 1, 2, 3, 1]]),  # a lone request: the view path
        ([(reqs[0], 19, 1), (reqs[2], 38, 3)], [[-1], [-1, 0, 0]]),  # a one-token request sees every key
    ]
    for requests, trees in cases:
        mask = tree_mask(*trees[: len(requests)])
        batch = ForwardBatch.prepare(pool, ForwardMode.TARGET_VERIFY, requests, tree_mask=mask)
        backend.init_forward_metadata(batch)
        q, k, v = new_tokens(batch, layer, dtype)
        out = backend.forward(q, k, v, layer, batch)
        assert out.dtype == dtype
        assert max_error(out, q, layer, batch) < tol, requests
        causal = dataclasses.replace(batch, tree_mask=None)
        assert float((reference_attention(q, layer, causal) - out.double()).abs().max()) > 0.05, "mask unused"


def test_a_tree_in_a_batch_of_one_token_requests_still_masks() -> None:
    """A one-token request whose block is False must not see itself: the decode path would let it."""
    pool = make_pool(2)
    layer = AttentionLayer(0, 4, 2, HEAD_DIM)
    backend = TorchNativeAttnBackend()
    reqs = alloc(pool, 2)
    run(backend, pool, ForwardMode.EXTEND, [(reqs[0], 0, 5), (reqs[1], 0, 7)], layer)
    mask = torch.tensor([True, False])
    batch = ForwardBatch.prepare(pool, ForwardMode.TARGET_VERIFY, [(reqs[0], 5, 1), (reqs[1], 7, 1)], tree_mask=mask)
    backend.init_forward_metadata(batch)
    q, k, v = new_tokens(batch, layer)
    assert max_error(backend.forward(q, k, v, layer, batch), q, layer, batch) < F32_TOL


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_a_query_that_sees_no_key_gets_zeros_found_once_per_batch(heads: int, kv_heads: int) -> None:
    """The contract: a tree row all False in a request without a prefix gives zeros. The plan finds those rows
    (and only those: a row that sees the prefix is an ordinary query); the float64 reference agrees."""
    torch.manual_seed(0)
    pool = make_pool(kv_heads)
    backend = TorchNativeAttnBackend()
    fresh, cached, lone = alloc(pool, 3)
    run(backend, pool, ForwardMode.EXTEND, [(cached, 0, 9)], AttentionLayer(0, heads, kv_heads, HEAD_DIM))
    pool.set_kv(1, pool.req_to_token[cached, :9], *(torch.randn(9, kv_heads, HEAD_DIM) for _ in "kv"))
    fresh_block, cached_block = tree_mask([-1, 0, 0, 1]).view(4, 4), tree_mask([-1, 0, 0, 1]).view(4, 4)
    fresh_block[1] = False  # sees no key
    cached_block[2] = False  # sees the prefix only
    mask = torch.cat([fresh_block.flatten(), cached_block.flatten(), torch.zeros(1, dtype=torch.bool)])
    batch = ForwardBatch.prepare(
        pool, ForwardMode.TARGET_VERIFY, [(fresh, 0, 4), (cached, 9, 4), (lone, 0, 1)], tree_mask=mask
    )
    backend.init_forward_metadata(batch)
    plan = backend._plan
    assert plan is not None
    blind = [None if req.blind is None else req.blind.flatten().tolist() for req in plan.requests]
    assert blind == [[False, True, False, False], None, [True]]
    for layer_id in (0, 1):
        layer = AttentionLayer(layer_id, heads, kv_heads, HEAD_DIM)
        q, k, v = new_tokens(batch, layer)
        out = backend.forward(q, k, v, layer, batch)
        ref = reference_attention(q, layer, batch)
        assert torch.equal(ref[[1, 8]], torch.zeros(2, heads, HEAD_DIM, dtype=torch.float64))
        assert torch.equal(out[[1, 8]], torch.zeros(2, heads, HEAD_DIM))
        assert float((out.double() - ref).abs().max()) < F32_TOL
        assert bool((ref[[0, 2, 3, 4, 5, 6, 7]].abs().amax(dim=(1, 2)) > 0).all()), "the other rows attend"


def test_tree_masks_are_built_once_per_batch() -> None:
    """Per-layer work does not grow with a tree: the second layer reuses the first layer's masks."""
    pool = make_pool(2)
    backend = TorchNativeAttnBackend()
    (r,) = alloc(pool, 1)
    run(backend, pool, ForwardMode.EXTEND, [(r, 0, 10)], AttentionLayer(0, 8, 2, HEAD_DIM))
    batch = ForwardBatch.prepare(pool, ForwardMode.TARGET_VERIFY, [(r, 10, 4)], tree_mask=tree_mask([-1, 0, 0, 1]))
    backend.init_forward_metadata(batch)
    masks = []
    for layer_id in (0, 1):
        layer = AttentionLayer(layer_id, 8, 2, HEAD_DIM)
        q, k, v = new_tokens(batch, layer)
        backend.forward(q, k, v, layer, batch)
        plan = backend._plan
        assert plan is not None
        masks.append(plan.requests[0].masks[4])
    assert masks[0] is masks[1] and masks[0] is not None
    assert masks[0].shape == (4 * 4, 14)  # the GQA group folded into the query rows


@pytest.mark.parametrize(
    ("mode", "requests", "mask", "message"),
    [
        (ForwardMode.DECODE, [(0, 4, 1)], torch.ones(1, dtype=torch.bool), "DECODE batches take no tree_mask"),
        (ForwardMode.TARGET_VERIFY, [(0, 4, 3)], torch.ones(3, dtype=torch.bool), r"shape \(9,\)"),
        (ForwardMode.TARGET_VERIFY, [(0, 4, 2)], torch.ones(2, 2, dtype=torch.bool), r"got torch.bool \(2, 2\)"),
    ],
)
def test_prepare_refuses_a_tree_mask_that_does_not_fit(
    mode: ForwardMode, requests: list[tuple[int, int, int]], mask: torch.Tensor, message: str
) -> None:
    pool = make_pool()
    pool.alloc_request()
    with pytest.raises(ValueError, match=message):
        ForwardBatch.prepare(pool, mode, requests, tree_mask=mask)
    assert pool.available_slots == pool.num_slots  # nothing was allocated


def test_forward_batch_checks_its_tree_mask_and_keeps_it_on_the_cache_device() -> None:
    pool = make_pool()
    (r,) = alloc(pool, 1)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 0, 2)], tree_mask=torch.tensor([1, 0, 1, 1]).bool())
    assert batch.tree_mask is not None and batch.tree_mask.dtype == torch.bool
    assert batch.tree_mask.tolist() == [True, False, True, True] and batch.tree_mask.device == pool.device
    with pytest.raises(ValueError, match="IDLE batches take no tree_mask"):
        dataclasses.replace(ForwardBatch.prepare(pool, ForwardMode.IDLE, []), tree_mask=torch.ones(0, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be a bool tensor"):
        dataclasses.replace(batch, tree_mask=torch.ones(4))
    additive = torch.tensor([0.0, float("-inf"), 0.0, 0.0])  # the same tree as an additive mask: never converted
    for mask in (additive, torch.tensor([1, 0, 1, 1])):
        with pytest.raises(ValueError, match=r"must be a bool tensor \(True: the token may attend\), got torch"):
            ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 2, 2)], tree_mask=mask)
    assert pool.available_slots == pool.num_slots - 2  # the refused batches took no slot


# -- a request table that names no slot -----------------------------------


@pytest.mark.parametrize(
    ("prefix_slots", "match"),
    [
        ([125, 126, 127], r"req_to_token\[0, 3\] = 128 \(request 0 of the batch\) is not a slot of layer 0's K/V"),
        ([-2, -1, 0], r"req_to_token\[0, 0\] = -2 \(request 0 of the batch\) is not a slot; the table must name"),
        ([7, 3, 11], r"req_to_token\[0, 3\] = 128 \(request 0 of the batch\) is not a slot of layer 0's K/V"),
    ],
    ids=["consecutive-past-the-end", "consecutive-negative", "fragmented-past-the-end"],
)
def test_a_table_entry_outside_the_cache_is_refused_naming_it_before_anything_is_written(
    prefix_slots: list[int], match: str
) -> None:
    """A row of consecutive slots running off a 128-slot cache was read as a truncated (or wrapped) view and
    returned normally; a fragmented one failed in the gather with a raw IndexError."""
    pool = make_pool(num_layers=1, num_slots=128)
    layer = AttentionLayer(0, 4, 2, HEAD_DIM)
    row = pool.alloc_request()
    for position, slot in enumerate(prefix_slots):
        pool.req_to_token[row, position] = slot
    last = prefix_slots[-1] + 1 if prefix_slots[0] != 7 else 128  # the new token: consecutive, or past the end
    pool.req_to_token[row, len(prefix_slots)] = last if prefix_slots[0] >= 0 else 1
    batch = ForwardBatch.from_lists(pool, ForwardMode.EXTEND, [(row, len(prefix_slots), 1)], torch.tensor([5]))
    before = (pool.k_buffer(0).clone(), pool.v_buffer(0).clone())
    backend = TorchNativeAttnBackend()
    q, k, v = new_tokens(batch, layer)
    with pytest.raises(ValueError, match=match):
        backend.init_forward_metadata(batch)
        backend.forward(q, k, v, layer, batch)
    assert torch.equal(pool.k_buffer(0), before[0]) and torch.equal(pool.v_buffer(0), before[1]), "written first"


# -- shapes that do not fit the layer and the batch --------------------------------------------


@pytest.mark.parametrize(
    ("q_shape", "match"),
    [
        ((4, 8, 32), r"q of shape \[4, 8, 32\] for layer 0, whose batch brings 2 new tokens.*expected \[2, 16, 32\]"),
        ((2, 32, 16), r"q of shape \[2, 32, 16\] for layer 0.*16 heads of 32: expected \[2, 16, 32\]"),
        ((2, 8, 64), r"q of shape \[2, 8, 64\].*expected \[2, 16, 32\] \(or flat \[2, 512\]\)"),
    ],
    ids=["tokens", "heads", "head_dim"],
)
def test_a_q_of_the_right_size_and_the_wrong_shape_is_refused_before_anything_is_written(
    q_shape: tuple[int, ...], match: str
) -> None:
    """A decode ``q`` of ``[4, 8, 32]`` for two tokens of 16 heads of 32 has the right element count: it was
    viewed as the layer's shape and attended, silently wrong."""
    pool = KVPool(1, 64, 4, 32, max_requests=4, max_context_len=16)
    layer = AttentionLayer(0, 16, 4, 32)
    rows = alloc(pool, 2)
    ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 0, 3) for r in rows])
    batch = ForwardBatch.prepare(pool, ForwardMode.DECODE, [(r, 3, 1) for r in rows])
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    _, k, v = new_tokens(batch, layer)
    before = pool.k_buffer(0).clone()
    with pytest.raises(ValueError, match=match):
        backend.forward(torch.randn(q_shape), k, v, layer, batch)
    assert torch.equal(pool.k_buffer(0), before), "the cache was written before the refusal"


def test_new_keys_of_the_wrong_shape_are_refused_before_anything_is_written() -> None:
    pool = KVPool(1, 64, 4, 32, max_requests=4, max_context_len=16)
    layer = AttentionLayer(0, 16, 4, 32)
    (row,) = alloc(pool, 1)
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(row, 0, 4)])
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    q, k, v = new_tokens(batch, layer)
    with pytest.raises(ValueError, match=r"k of shape \[8, 2, 32\].*4 new tokens.*expected \[4, 4, 32\]"):
        backend.forward(q, k.reshape(8, 2, 32), v, layer, batch)
    with pytest.raises(ValueError, match=r"v of shape \[4, 4, 16\]"):
        backend.forward(q, k, v[..., :16], layer, batch)
    assert not pool.k_buffer(0).any() and not pool.v_buffer(0).any(), "the cache was written before the refusal"
    assert backend.forward(q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1), layer, batch).shape == (4, 512)


def _mla_batch() -> tuple[object, ForwardBatch, TorchNativeAttnBackend]:
    from attnhost.mla import MLAConfig
    from attnhost.mla_pool import MLAKVPool

    config = MLAConfig(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=4)
    pool = MLAKVPool(1, 32, config, max_requests=2, max_context_len=8)
    rows = [pool.alloc_request() for _ in range(2)]
    batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 0, 3) for r in rows])  # 6 tokens
    backend = TorchNativeAttnBackend()
    backend.init_forward_metadata(batch)
    return config, batch, backend


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        ({"q": (9, 2, 8)}, r"q of shape \[9, 2, 8\] for layer 0, whose batch brings 6 new tokens.*\[6, 2, 12\]"),
        ({"k": (9, 1, 8)}, r"k of shape \[9, 1, 8\].*expected \[6, 1, 12\]"),
        ({"k": (6, 1, 8), "k_rope": (3, 1, 8)}, r"k_rope of shape \[3, 1, 8\].*expected \[6, 1, 4\]"),
    ],
    ids=["q", "k", "k_rope"],
)
def test_mla_absorbed_inputs_of_the_wrong_shape_are_refused_before_a_latent_row_is_written(
    shapes: dict[str, tuple[int, ...]], match: str
) -> None:
    from attnhost.mla import MLAForm

    config, batch, backend = _mla_batch()
    layer = AttentionLayer.for_mla(config, MLAForm.ABSORBED, 0, 2)  # type: ignore[arg-type]
    q = torch.randn(shapes.get("q", (6, 2, 12)))
    k = torch.randn(shapes.get("k", (6, 1, 12)))
    k_rope = torch.randn(shapes["k_rope"]) if "k_rope" in shapes else None
    with pytest.raises(ValueError, match=match):
        backend.forward_mla_mqa(q, k, None, layer, batch, True, None, k_rope)
    assert not batch.kv_pool.k_buffer(0).any(), "a latent row was written before the refusal"


def test_mla_mha_values_of_the_wrong_width_are_refused() -> None:
    from attnhost.mla import MLAForm

    config, batch, backend = _mla_batch()
    layer = AttentionLayer.for_mla(config, MLAForm.MHA, 0, 2)  # type: ignore[arg-type]
    q, k = torch.randn(6, 2, 12), torch.randn(6, 2, 12)
    with pytest.raises(ValueError, match=r"v of shape \[3, 2, 8\].*expected \[6, 2, 4\]"):
        backend.forward_mla_mha(q, k, torch.randn(3, 2, 8), layer, batch)


# -- a batch whose device tensors disagree with its host lengths or its table ------------------


def _decode_batch() -> ForwardBatch:
    pool = make_pool()
    rows = alloc(pool, 2)
    ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(r, 0, 3) for r in rows])
    return ForwardBatch.prepare(pool, ForwardMode.DECODE, [(r, 3, 1) for r in rows])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"req_pool_indices": [0, -1]}, r"req_pool_indices\[1\] = -1 is not a row of req_to_token \(rows 0 to 7\)"),
        ({"req_pool_indices": [0, 8]}, r"req_pool_indices\[1\] = 8 is not a row of req_to_token"),
        ({"seq_lens": [4, 5], "prefix_lens": [3, 4]}, r"seq_lens\[1\] = 5 on the device, 4 in seq_lens_cpu"),
        ({"prefix_lens": [3, 2]}, r"request 1: prefix_lens 2 \+ extend_seq_lens 1 != seq_lens 4 on the device"),
    ],
    ids=["row-minus-one", "row-past-the-table", "seq-lens-disagree", "prefix-disagrees"],
)
def test_a_batch_whose_device_tensors_disagree_is_refused_naming_the_entry(
    change: dict[str, list[int]], match: str
) -> None:
    """``req_pool_indices = -1`` was wrapped to the table's last row, and device lengths other than the host's
    were read by some backends and not by others."""
    batch = _decode_batch()
    fields = {name: torch.tensor(values) for name, values in change.items()}
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(batch, **fields)


def test_host_bounds_admit_shorter_device_lengths_and_nothing_longer() -> None:
    batch = _decode_batch()
    bounded = dataclasses.replace(
        batch, seq_lens_cpu=(6, 6), prefix_lens_cpu=(5, 5), host_lengths_exact=False
    )  # the device's 4s within the bounds
    assert bounded.seq_lens.tolist() == [4, 4]
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 4 on the device, outside \[1, 3\] \(its host bounds\)"):
        dataclasses.replace(batch, seq_lens_cpu=(3, 6), prefix_lens_cpu=(2, 5), host_lengths_exact=False)


def test_a_batch_of_no_requests_is_idle_or_refused() -> None:
    pool = make_pool()
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="this EXTEND batch has no requests; use IDLE for none"):
        ForwardBatch(ForwardMode.EXTEND, pool, empty, empty, empty, empty, empty, (), (), ())
    assert ForwardBatch(ForwardMode.IDLE, pool, empty, empty, empty, empty, empty, (), (), ()).batch_size == 0
