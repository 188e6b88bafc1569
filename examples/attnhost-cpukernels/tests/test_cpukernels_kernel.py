"""What the conformance kit does not reach: tree masks, strided caches, int32 tables, shared slots, threads.

Every case is checked against a float64 reference written out here (explicit mask, softmax by definition) on a
cache whose slots are shuffled, as a long-running server's are.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch
from attnhost_cpukernels.backend import CpuPagedAttnBackend, kernel_info

from attnhost import AttentionLayer, ForwardBatch, ForwardMode, KVPool
from attnhost.dtypes import quantize_fp8

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
Request = tuple[int, int, int]  # (table row, prefix_len, extend_len)


class StridedCache:
    """A KVCache whose K/V buffers are strided views into wider tensors and whose table is int32."""

    def __init__(self, slots: int, kv_heads: int, dim: int, rows: int, width: int, dtype: torch.dtype) -> None:
        # every other head of a twice-as-wide buffer, each row padded: no stride is the dense one
        self._k = torch.zeros(slots, 2 * kv_heads, dim + 8, dtype=dtype)[:, ::2, :dim]
        self._v = torch.zeros(slots, kv_heads, 2 * dim, dtype=dtype)[:, :, dim:]
        self.req_to_token = torch.zeros(rows, width, dtype=torch.int32)
        self.device, self.dtype = torch.device("cpu"), dtype
        self.page_size = 1

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self._k

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self._v

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self._k.index_copy_(0, loc, k.to(self.dtype))
        self._v.index_copy_(0, loc, v.to(self.dtype))


def _pool(kv_heads: int, dim: int, dtype: torch.dtype, strided: bool, slots: int = 8192) -> KVPool | StridedCache:
    if strided:
        return StridedCache(slots, kv_heads, dim, 8, 4096, dtype)
    return KVPool(1, slots, kv_heads, dim, max_requests=8, max_context_len=4096, dtype=dtype)


def _batch(
    pool: KVPool | StridedCache,
    mode: ForwardMode,
    requests: Sequence[Request],
    gen: torch.Generator,
    tree_mask: torch.Tensor | None = None,
    shared_prefix: int = 0,
) -> ForwardBatch:
    """Shuffled slots for every request's tokens; the first ``shared_prefix`` positions of all rows share slots."""
    slots = pool.k_buffer(0).shape[0]
    order = torch.randperm(slots, generator=gen)
    shared, taken = order[:shared_prefix], shared_prefix
    new: list[torch.Tensor] = []
    for row, prefix, extend in requests:
        own = order[taken : taken + prefix + extend - shared_prefix]
        taken += len(own)
        pool.req_to_token[row, : prefix + extend] = torch.cat([shared, own]).to(pool.req_to_token.dtype)
        new.append(pool.req_to_token[row, prefix : prefix + extend].to(torch.int64))
        k = torch.randn(prefix, pool.k_buffer(0).shape[1], pool.k_buffer(0).shape[2], generator=gen)
        fill = pool.req_to_token[row, :prefix].to(torch.int64)
        pool.k_buffer(0)[fill] = k.to(pool.dtype)
        pool.v_buffer(0)[fill] = torch.randn(k.shape, generator=gen).to(pool.dtype)
    return ForwardBatch.from_lists(pool, mode, requests, torch.cat(new), tree_mask)  # type: ignore[arg-type]


def _reference(q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
    pool = batch.kv_pool
    q = q.reshape(-1, layer.num_heads, layer.head_dim).double()
    group = layer.num_heads // layer.num_kv_heads
    outs, cell = [], 0
    for i in range(batch.batch_size):
        row, prefix, extend = int(batch.req_pool_indices[i]), batch.prefix_lens_cpu[i], batch.extend_seq_lens_cpu[i]
        slots = pool.req_to_token[row, : prefix + extend].long()
        k = pool.k_buffer(0)[slots].double().repeat_interleave(group, dim=1)
        v = pool.v_buffer(0)[slots].double().repeat_interleave(group, dim=1)
        start = batch.extend_start_loc_cpu[i]
        scores = torch.einsum("qhd,khd->hqk", q[start : start + extend], k) * layer.scaling
        allowed = torch.ones(extend, prefix + extend, dtype=torch.bool)
        if batch.tree_mask is None:
            allowed[:, prefix:] = torch.ones(extend, extend, dtype=torch.bool).tril()
        else:
            allowed[:, prefix:] = batch.tree_mask[cell : cell + extend * extend].view(extend, extend)
            cell += extend * extend
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        weights = weights.masked_fill(~allowed.any(-1)[None, :, None], 0.0)  # a query that sees no key gets zeros
        outs.append(torch.einsum("hqk,khd->qhd", weights, v))
    return torch.cat(outs)


def _check(
    batch: ForwardBatch, layer: AttentionLayer, dtype: torch.dtype, gen: torch.Generator, flat: bool = False
) -> None:
    backend = CpuPagedAttnBackend()
    backend.init_forward_metadata(batch)
    n = batch.num_new_tokens
    q = torch.randn(n, layer.num_heads, layer.head_dim, generator=gen).to(dtype)
    k = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen).to(dtype)
    v = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen).to(dtype)
    out = backend.forward(q.flatten(1) if flat else q, k, v, layer, batch)
    assert out.dtype == dtype and out.shape == ((n, layer.num_heads * layer.head_dim) if flat else q.shape)
    expected = _reference(q, layer, batch)
    error = (out.view_as(q).double() - expected).abs().max().item()
    assert error <= ATOL[dtype], f"max abs error {error:.2e} ({kernel_info()})"


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# GQA, MHA, MQA (a head dim no vector width divides), odd; half of them on strided caches with int32 tables
HEADS = [(8, 2, 128, False), (4, 4, 64, True), (8, 1, 72, True), (6, 3, 24, False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "strided"), HEADS)
def test_mixed_batch(threads: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, strided: bool) -> None:
    """Prefill, extend over a prefix and a one-token request in one EXTEND batch; then a decode batch."""
    gen = torch.Generator().manual_seed(heads * dim + kv_heads)
    layer = AttentionLayer(0, heads, kv_heads, dim)
    pool = _pool(kv_heads, dim, dtype, strided)
    _check(_batch(pool, ForwardMode.EXTEND, [(0, 0, 37), (3, 70, 1), (5, 100, 45)], gen), layer, dtype, gen)
    decode = [(0, 77, 1), (2, 1, 1), (3, 600, 1), (6, 33, 1)]
    _check(_batch(pool, ForwardMode.DECODE, decode, gen), layer, dtype, gen, flat=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch_size", [1, 8])
def test_long_decode(threads: int, dtype: torch.dtype, batch_size: int) -> None:
    """Long contexts: the context split of a lone request (threads > 1) and its merge."""
    gen = torch.Generator().manual_seed(batch_size)
    layer = AttentionLayer(0, 8, 2, 128)
    pool = _pool(2, 128, dtype, False, slots=40000)
    requests = [(i, 2047 + 13 * i, 1) for i in range(batch_size)]
    _check(_batch(pool, ForwardMode.DECODE, requests, gen), layer, dtype, gen)


def _tree(extend: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree over the new tokens (each one's parent precedes it): a token sees itself and its ancestors."""
    parent = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, extend)]
    mask = torch.zeros(extend, extend, dtype=torch.bool)
    for j in range(extend):
        a = j
        while a >= 0:
            mask[j, a] = True
            a = parent[a]
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_mask(threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    layer = AttentionLayer(0, 8, 2, 64)
    requests = [(0, 50, 9), (1, 0, 6), (4, 300, 40)]
    masks = [_tree(e, gen) for _, _, e in requests]
    # one block that is not a tree at all (a token sees a later one, not itself): any mask is honoured as given
    masks[2][5] = torch.arange(40) % 3 == 1
    pool = _pool(2, 64, dtype, True)
    tree = torch.cat([m.flatten() for m in masks])
    _check(_batch(pool, ForwardMode.TARGET_VERIFY, requests, gen, tree), layer, dtype, gen, flat=True)


def _blocks(*rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Tree-mask blocks from each request's rows (the new tokens each new token sees), concatenated."""
    out = []
    for block in rows:
        mask = torch.zeros(len(block), len(block), dtype=torch.bool)
        for j, seen in enumerate(block):
            mask[j, list(seen)] = True
        out.append(mask.flatten())
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_query_that_sees_no_key_gets_zeros(threads: int, dtype: torch.dtype) -> None:
    """A tree row that is all False over an empty prefix: the contract's zeros, beside rows that see keys."""
    gen = torch.Generator().manual_seed(19)
    layer = AttentionLayer(0, 8, 2, 64)
    pool = _pool(2, 64, dtype, True)
    requests = [(0, 0, 4), (1, 20, 3), (4, 0, 1)]
    tree = _blocks([[], [1], [], [0, 3]], [[0], [], [0, 2]], [[]])
    batch = _batch(pool, ForwardMode.TARGET_VERIFY, requests, gen, tree)
    _check(batch, layer, dtype, gen)  # against the reference, whose rows without a key are zeros
    backend = CpuPagedAttnBackend()
    backend.init_forward_metadata(batch)
    q = torch.randn(8, 8, 64, generator=gen).to(dtype)
    out = backend.forward(q, q[:, :2], q[:, 2:4], layer, batch)
    assert torch.equal(out[[0, 2, 7]], torch.zeros(3, 8, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_query_that_sees_no_key_gets_zeros_whatever_the_masked_slots_hold(threads: int, dtype: torch.dtype) -> None:
    """Not 0 x NaN: the masked keys' slots hold NaN here (as an unwritten slot of a real cache may)."""
    gen = torch.Generator().manual_seed(23)
    layer = AttentionLayer(0, 8, 2, 64)
    pool = _pool(2, 64, dtype, False)
    batch = _batch(pool, ForwardMode.TARGET_VERIFY, [(0, 0, 3), (4, 0, 1)], gen, _blocks([[], [], []], [[]]))
    pool.k_buffer(0)[batch.out_cache_loc] = float("nan")
    pool.v_buffer(0)[batch.out_cache_loc] = float("nan")
    backend = CpuPagedAttnBackend()
    backend.init_forward_metadata(batch)
    q = torch.randn(4, 8, 64, generator=gen).to(dtype)
    out = backend.forward(q, q[:, :2], q[:, :2], layer, batch, save_kv_cache=False)
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.parametrize("long_prefix", [False, True], ids=["one-piece", "split-context"])
def test_a_row_whose_only_visible_key_is_nan_is_nan_as_in_torch_native_and_the_reference(
    threads: int, long_prefix: bool
) -> None:
    """The contract's one rule: a row that sees no key is zeros; a row that sees a NaN key is NaN (it gave zeros
    here, NaN in torch_native and the reference). Over a long prefix the context is split in pieces and merged."""
    from attnhost.testing.reference import reference_attention
    from attnhost_builtin.torch_native import TorchNativeAttnBackend

    gen = torch.Generator().manual_seed(31)
    layer = AttentionLayer(0, 8, 2, 64)
    pool = _pool(2, 64, torch.float32, False)
    prefix = 1500 if long_prefix else 0
    # row 2 sees only its own key, the NaN one, in the third lane of the kernel's block (a NaN in the first lane
    # reached the output anyway); over a long prefix the NaN key is one of many a split context's pieces read
    tree = _blocks([[0], [0, 1], [2]]) if not long_prefix else torch.tensor([True])
    batch = _batch(pool, ForwardMode.TARGET_VERIFY, [(0, prefix, 3 if not long_prefix else 1)], gen, tree)
    nan_key = batch.out_cache_loc[2:3] if not long_prefix else pool.req_to_token[0, 700:701]
    pool.k_buffer(0)[nan_key] = float("nan")
    q = torch.randn(batch.num_new_tokens, 8, 64, generator=gen)
    outs = []
    for backend in (CpuPagedAttnBackend(), TorchNativeAttnBackend()):
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, q[:, :2], q[:, :2], layer, batch, save_kv_cache=False))
    reference = reference_attention(q, layer, batch)
    nan_rows = reference.isnan().flatten(1).all(1)
    assert bool(nan_rows[-1]), "the reference's last row sees a NaN key: NaN"
    rows = outs[0].isnan().flatten(1).any(1).tolist()
    assert torch.equal(outs[0].isnan(), reference.isnan()), f"cpu_paged: NaN rows {rows}, reference's {nan_rows}"
    # torch_native agrees on every row that sees the NaN key (its masks are additive, so a NaN key another tree
    # branch does not see reaches that branch too, as docs/variants.md says)
    assert bool(outs[1][nan_rows].isnan().all()), "torch_native: a row that sees a NaN key is not NaN"
    if not long_prefix:
        torch.testing.assert_close(outs[0].double(), reference, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("sees_itself", [False, True])
def test_a_tree_row_over_a_split_context(threads: int, sees_itself: bool) -> None:
    """One new token over a long prefix (with two threads its context is split and merged): its one-cell tree
    block decides whether it sees itself; the prefix it always sees."""
    gen = torch.Generator().manual_seed(29)
    layer = AttentionLayer(0, 8, 2, 128)
    pool = _pool(2, 128, torch.float32, False, slots=4096)
    tree = torch.tensor([sees_itself])
    _check(_batch(pool, ForwardMode.TARGET_VERIFY, [(0, 1500, 1)], gen, tree), layer, torch.float32, gen)


def test_decode_requests_sharing_prefix_slots(threads: int) -> None:
    """Draft decode with several branches: requests whose rows hold the same prefix slots."""
    gen = torch.Generator().manual_seed(3)
    layer = AttentionLayer(0, 8, 2, 128)
    pool = _pool(2, 128, torch.float32, False)
    requests = [(row, 900, 1) for row in range(4)]
    _check(_batch(pool, ForwardMode.DECODE, requests, gen, shared_prefix=900), layer, torch.float32, gen)


def test_threads_agree_and_torch_threads_are_honoured() -> None:
    """The split over threads changes the order of float sums only: outputs agree to rounding."""
    gen = torch.Generator().manual_seed(11)
    layer = AttentionLayer(0, 8, 2, 128)
    pool = _pool(2, 128, torch.float32, False, slots=20000)
    batch = _batch(pool, ForwardMode.DECODE, [(0, 4000, 1)], gen)
    q = torch.randn(1, 8, 128, generator=gen)
    outs = []
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            backend = CpuPagedAttnBackend()
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, q[:, :2], q[:, :2], layer, batch, save_kv_cache=False))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)


def test_kernel_reports_its_build() -> None:
    info = kernel_info()
    assert info["built_with_torch"] == torch.__version__.split("+")[0]
    assert info["isa"] in ("avx512", "avx2", "baseline")


def test_requests_in_any_table_order() -> None:
    """Table rows need not follow batch order, nor be distinct from other batches' rows."""
    gen = torch.Generator().manual_seed(5)
    layer = AttentionLayer(0, 4, 2, 32)
    pool = _pool(2, 32, torch.float32, False)
    for rows in itertools.permutations((1, 4, 6)):
        requests = [(row, 10 * row, 2) for row in rows]
        _check(_batch(pool, ForwardMode.EXTEND, requests, gen), layer, torch.float32, gen)


@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_writes_the_new_kv_at_their_slots_and_nowhere_else(dtype: torch.dtype, strided: bool) -> None:
    """The cache write is fused into the call: the new rows land at ``out_cache_loc``, bit for bit, and no other
    byte of either buffer changes; new K/V of another dtype go through ``set_kv``, converted. On the strided
    cache, ``out_cache_loc`` is a strided view too, as SGLang's speculative batches hand it."""
    gen = torch.Generator().manual_seed(13)
    layer = AttentionLayer(0, 8, 2, 64)
    for given in (dtype, torch.float32 if dtype != torch.float32 else torch.bfloat16):
        pool = _pool(2, 64, dtype, strided, slots=512)
        batch = _batch(pool, ForwardMode.EXTEND, [(0, 20, 5), (3, 0, 7), (6, 40, 1)], gen)
        if strided:
            batch = dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc.repeat_interleave(2)[::2])
            assert batch.out_cache_loc.stride(0) == 2
        before_k, before_v = pool.k_buffer(0).clone(), pool.v_buffer(0).clone()
        n = batch.num_new_tokens
        k, v = (torch.randn(n, 2, 64, generator=gen).to(given) for _ in range(2))
        backend = CpuPagedAttnBackend()
        backend.init_forward_metadata(batch)
        backend.forward(torch.randn(n, 8, 64, generator=gen).to(dtype), k.flatten(1), v.flatten(1), layer, batch)
        loc = batch.out_cache_loc
        untouched = torch.ones(512, dtype=torch.bool)
        untouched[loc] = False
        assert torch.equal(pool.k_buffer(0)[loc], k.to(dtype)) and torch.equal(pool.v_buffer(0)[loc], v.to(dtype))
        assert torch.equal(pool.k_buffer(0)[untouched], before_k[untouched])
        assert torch.equal(pool.v_buffer(0)[untouched], before_v[untouched])


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written() -> None:
    gen = torch.Generator().manual_seed(17)
    layer = AttentionLayer(0, 4, 2, 32)
    pool = _pool(2, 32, torch.float32, False, slots=256)
    batch = _batch(pool, ForwardMode.EXTEND, [(0, 10, 3)], gen)
    batch.out_cache_loc[1] = 256  # one past the last slot
    before = pool.k_buffer(0).clone()
    backend = CpuPagedAttnBackend()
    backend.init_forward_metadata(batch)
    k = torch.randn(3, 2, 32, generator=gen)
    with pytest.raises(RuntimeError, match=r"out_cache_loc\[1\] = 256 is not a slot of this cache \(256 slots\)"):
        backend.forward(torch.randn(3, 4, 32, generator=gen), k, k, layer, batch)
    assert torch.equal(pool.k_buffer(0), before)


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _finite_fp8_bytes(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random FP8 bit patterns of every finite kind (subnormals, zeros of both signs, the largest values)."""
    raw = torch.randint(0, 256, (n,), generator=gen, dtype=torch.int32)
    special = (raw & 0x7F) == 0x7F if dtype == torch.float8_e4m3fn else (raw & 0x7C) == 0x7C  # NaN, inf
    return torch.where(special, raw & 0x80, raw).to(torch.uint8)


def _paged_batch(pool: KVPool, mode: ForwardMode, requests: Sequence[Request], gen: torch.Generator) -> ForwardBatch:
    """Each request's pages drawn at random from the whole pool (no two requests share one), its prefix filled
    with random finite FP8 bytes or random floats."""
    size = pool.page_size
    order = torch.randperm(pool.num_pages, generator=gen)
    taken = 0
    new = []
    for row, prefix, extend in requests:
        count = -(-(prefix + extend) // size)
        pages = order[taken : taken + count]
        taken += count
        slots = (pages[:, None] * size + torch.arange(size)).flatten()[: prefix + extend]
        pool.req_to_token[row, : prefix + extend] = slots
        new.append(slots[prefix:])
        for buffer in (pool.k_buffer(0), pool.v_buffer(0)):
            shape = (prefix, *buffer.shape[1:])
            if pool.is_fp8:
                cells = _finite_fp8_bytes(prefix * shape[1] * shape[2], pool.dtype, gen).view(shape)
                buffer.view(torch.uint8)[slots[:prefix]] = cells
            else:
                buffer[slots[:prefix]] = torch.randn(shape, generator=gen).to(pool.dtype)
    return ForwardBatch.from_lists(pool, mode, requests, torch.cat(new))


def _check_paged(batch: ForwardBatch, layer: AttentionLayer, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Against the float64 reference over the cache as the contract reads it (an FP8 entry: stored * scale), after
    the write, whose bytes must be the contract's quantising write of the new K/V."""
    pool = batch.kv_pool
    assert isinstance(pool, KVPool)
    backend = CpuPagedAttnBackend()
    backend.init_forward_metadata(batch)
    n = batch.num_new_tokens
    q = torch.randn(n, layer.num_heads, layer.head_dim, generator=gen).to(dtype)
    k = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen).to(dtype)
    v = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen).to(dtype)
    out = backend.forward(q, k, v, layer, batch)
    loc = batch.out_cache_loc
    if pool.is_fp8:
        for buffer, new, scale in ((pool.k_buffer(0), k, layer.k_scale), (pool.v_buffer(0), v, layer.v_scale)):
            written = buffer[loc].view(torch.uint8)
            assert torch.equal(written, quantize_fp8(new, scale, pool.dtype).view(torch.uint8))
    dequantised = StridedCache(
        pool.num_slots, layer.num_kv_heads, layer.head_dim, pool.max_requests, 4096, torch.float64
    )
    scales = (layer.k_scale, layer.v_scale) if pool.is_fp8 else (1.0, 1.0)
    dequantised.k_buffer(0).copy_(pool.k_buffer(0).to(torch.float64) * scales[0])
    dequantised.v_buffer(0).copy_(pool.v_buffer(0).to(torch.float64) * scales[1])
    dequantised.req_to_token = pool.req_to_token
    expected = _reference(q, layer, dataclasses.replace(batch, kv_pool=dequantised))
    error = (out.view_as(q).double() - expected).abs().max().item()
    assert error <= ATOL[dtype], f"max abs error {error:.2e} ({kernel_info()})"


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("cache", ["e4m3", "e5m2", "bfloat16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 128), (4, 4, 72)])
def test_fp8_and_paged_caches(threads: int, page_size: int, cache: str, heads: int, kv_heads: int, dim: int) -> None:
    """Pages in random order, prefixes ending inside a page, an extend long enough for the transposed-key path
    and one too short for it, then decode; FP8 caches of random finite bytes (subnormals, the largest values)
    read with the layer's scales, against the float64 reference over the dequantised cache."""
    gen = torch.Generator().manual_seed(page_size + dim + len(cache))
    kv_dtype = FP8.get(cache, torch.bfloat16)
    layer = AttentionLayer(0, heads, kv_heads, dim, k_scale=1.5 / 448, v_scale=2.5 / 448)
    if kv_dtype == torch.float8_e5m2:
        layer = dataclasses.replace(layer, k_scale=1.5 / 57344, v_scale=2.5 / 57344)
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool(1, 8192, kv_heads, dim, max_requests=8, max_context_len=4096, dtype=kv_dtype, page_size=page_size)
        extend = [(0, 0, 37), (3, 70, 1), (5, 123, 45), (6, 17, 3)]
        _check_paged(_paged_batch(pool, ForwardMode.EXTEND, extend, gen), layer, dtype, gen)
        decode = [(0, 77, 1), (2, 1, 1), (3, 600, 1), (6, 33, 1)]
        _check_paged(_paged_batch(pool, ForwardMode.DECODE, decode, gen), layer, dtype, gen)


def test_a_page_outside_the_cache_is_refused() -> None:
    gen = torch.Generator().manual_seed(31)
    layer = AttentionLayer(0, 4, 2, 32)
    pool = KVPool(1, 256, 2, 32, max_requests=2, max_context_len=64, page_size=16)
    batch = _paged_batch(pool, ForwardMode.EXTEND, [(0, 20, 3)], gen)
    pool.req_to_token[0, 16:32] += 256  # the request's second page, a pool's worth past the last
    backend = CpuPagedAttnBackend()
    backend.init_forward_metadata(batch)
    kv = torch.randn(3, 2, 32, generator=gen)
    with pytest.raises(RuntimeError, match=r"page_table\[0, 1\] = \d+ .* is not a page of this layer's K/V buffers"):
        backend.forward(torch.randn(3, 4, 32, generator=gen), kv, kv, layer, batch, save_kv_cache=False)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ([5, 6, 7, 8], r"req_to_token\[0, 0\] = 5 \(request 0 of the batch\) is not the first slot of a page of 4"),
        ([4, 9, 10, 11], r"req_to_token\[0, 1\] = 9 \(request 0 of the batch\) is not slot 5 of the page that starts"),
        ([8, 9, 10, 11, 12, 14], r"req_to_token\[0, 5\] = 14 .* is not slot 13 of the page that starts at slot 12"),
    ],
    ids=["not-page-aligned", "page-broken-inside", "second-page-broken"],
)
def test_a_paged_table_that_is_not_whole_pages_is_refused_naming_the_entry(row: list[int], match: str) -> None:
    """With pages the kernel reads each page's slots as one run: a table row that is not whole pages in order (here
    at page size 4) would have it read other slots, silently; it is refused when the batch is planned."""
    pool = KVPool(1, 64, 2, 32, max_requests=2, max_context_len=32, page_size=4)
    pool.req_to_token[0, : len(row)] = torch.tensor(row)
    batch = ForwardBatch.from_lists(pool, ForwardMode.DECODE, [(0, len(row) - 1, 1)], torch.tensor([row[-1]]))
    with pytest.raises(RuntimeError, match=match):
        CpuPagedAttnBackend().init_forward_metadata(batch)


@pytest.mark.parametrize("cache", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [128, 72, 24])
def test_every_fp8_byte_reads_as_its_value_times_the_scale(cache: str, dim: int) -> None:
    """All 256 bit patterns (subnormals, the largest values, NaN, e5m2's infinities) as the one key's values: a
    zero query's output is that row, which must be exactly ``stored.to(float32) * v_scale``, on the decode path
    (1 and 4 query rows) and the transposed-key path (16 rows)."""
    kv_dtype = FP8[cache]
    for heads in (1, 4, 16):
        layer = AttentionLayer(0, heads, 1, dim, k_scale=0.75, v_scale=0.375)
        for start in range(0, 256, dim):
            pool = KVPool(1, 64, 1, dim, max_requests=1, max_context_len=64, dtype=kv_dtype)
            pool.v_buffer(0).view(torch.uint8)[3] = (
                (torch.arange(start, start + dim) % 256).to(torch.uint8).view(1, dim)
            )
            pool.req_to_token[0, 0] = 3
            batch = ForwardBatch.from_lists(pool, ForwardMode.DECODE, [(0, 0, 1)], torch.tensor([3]))
            backend = CpuPagedAttnBackend()
            backend.init_forward_metadata(batch)
            q = torch.zeros(1, heads, dim)
            out = backend.forward(q, q[:, :1], q[:, :1], layer, batch, save_kv_cache=False)
            want = (pool.v_buffer(0)[3].to(torch.float32) * layer.v_scale).expand(1, heads, dim)
            torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
