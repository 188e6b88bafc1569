"""The KV cache and the per-forward batch that attention backends read.

SGLang's: every cached token owns one *slot* in a per-layer K and V buffer, and ``req_to_token`` maps (request
slot, position) to it; slots come in pages of ``page_size`` (1: token slots), and the buffers may be FP8, written
by the quantising write (docs/kv-cache.md). A ``ForwardBatch`` mirrors its lengths as ints, so per-layer code never
syncs with the device for a shape.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from attnhost.errors import KVPoolFullError, safe_repr
from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache

__all__ = ["FP8_DTYPES", "ForwardBatch", "KVPool", "quantize_fp8"]


def check_size(owner: str, name: str, value: object) -> None:
    """Refuse a size that is not a positive ``int``, naming it: a float or 0 would fail far from its cause."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def float_dtype(owner: str, dtype: object) -> torch.dtype:
    """A floating-point torch dtype, from one or its name: an integer KV cache would make attention all zeros."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"{owner}: dtype {dtype!r} is not a torch dtype; use e.g. torch.float32 or 'bfloat16'")
    if not resolved.is_floating_point:
        raise ValueError(
            f"{owner}: dtype {str(resolved).removeprefix('torch.')} is not a floating-point dtype; "
            "attention and its KV cache need one (float32, bfloat16, float16)"
        )
    return resolved


FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 cache formats (``attnhost.backend.FP8_KV_DTYPES`` by name)."""


def resolve_kv_cache_dtype(owner: str, dtype: object) -> torch.dtype:
    """A KV cache's dtype: a float one (:func:`float_dtype`) or one of :data:`FP8_DTYPES`; the other 8-bit floats
    (``*_fnuz``, ``e8m0``) are refused, as no engine's cache here stores them."""
    resolved = float_dtype(owner, dtype)
    if resolved.itemsize == 1 and resolved not in FP8_DTYPES:
        raise ValueError(
            f"{owner}: KV-cache dtype {str(resolved).removeprefix('torch.')} is not one the contract knows; "
            "an FP8 cache is float8_e4m3fn or float8_e5m2"
        )
    return resolved


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The contract's quantising write (docs/kv-cache.md): ``saturate(x / scale)`` cast to ``dtype``, computed in
    float32, saturate clamping to ``±finfo(dtype).max``. Clamping first makes overflow the largest finite value in
    both formats (a bare cast gives ``inf`` in e5m2), and leaves NaN a NaN."""
    limit = torch.finfo(dtype).max
    scaled = x.to(torch.float32)
    if scale != 1.0:
        scaled = scaled / scale
    return scaled.clamp(-limit, limit).to(dtype)


class KVPool:
    """Per-layer K/V buffers indexed by token slot, plus the request-to-slot table. Allocation is FIFO, so the same
    calls always yield the same slots (tests and benchmarks need reproducible layouts), and a fresh pool hands out
    ascending runs, which backends read as zero-copy views.

    With ``page_size > 1`` slots come in pages, as in SGLang's paged allocator: ``num_slots`` rounds down to whole
    pages, slot ``s`` is offset ``s % page_size`` of page ``s // page_size``, and :meth:`ForwardBatch.prepare`
    fills a request's pages in order. ``dtype`` may be FP8 (:data:`FP8_DTYPES`): ``set_kv`` then quantises.

    ``table_dtype`` is ``req_to_token``'s: int64, or int32 as SGLang keeps it. ``fused_kv`` keeps each layer's K and V
    in one ``[slots, 2, kv_heads, head_dim]`` buffer, as engines that allocate a layer's cache in one piece do: the
    K and V buffers are then strided views, which the :class:`KVCache` contract allows."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_requests: int,
        max_context_len: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        table_dtype: torch.dtype = torch.int64,
        fused_kv: bool = False,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.page_size = page_size
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_requests", "max_context_len", "page_size"):
            check_size("KVPool", name, getattr(self, name))
        check_size("KVPool", "num_slots", num_slots)
        if num_slots < page_size:
            raise ValueError(f"KVPool: num_slots={num_slots} is less than one page (page_size={page_size})")
        self.num_slots = num_slots - num_slots % page_size
        self.num_pages = self.num_slots // page_size
        self.dtype = resolve_kv_cache_dtype("KVPool", dtype)
        self.is_fp8 = self.dtype in FP8_DTYPES
        self.device = torch.device(device)
        if table_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"KVPool: table_dtype must be torch.int32 or torch.int64, got {table_dtype}")
        shape = (self.num_slots, num_kv_heads, head_dim)
        if fused_kv:
            fused = [
                torch.zeros((self.num_slots, 2, num_kv_heads, head_dim), dtype=self.dtype, device=self.device)
                for _ in range(num_layers)
            ]
            self._k, self._v = [b[:, 0] for b in fused], [b[:, 1] for b in fused]
        else:
            self._k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
            self._v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        # index_copy_ has no FP8 kernel: an FP8 cache is written through a byte view of the same memory.
        self._k_store = [b.view(torch.uint8) for b in self._k] if self.is_fp8 else self._k
        self._v_store = [b.view(torch.uint8) for b in self._v] if self.is_fp8 else self._v
        self.req_to_token = torch.zeros((max_requests, max_context_len), dtype=table_dtype, device=self.device)
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)  # on the CPU: bookkeeping, not data
        self._page_fill = [0] * self.num_pages  # per page, how many leading slots a token holds
        self._free_requests: dict[int, None] = dict.fromkeys(range(max_requests))  # a FIFO set

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        return self._k[self._check_layer(layer_id)]

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        return self._v[self._check_layer(layer_id)]

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write the new tokens' K/V at slots ``loc`` with one ``index_copy_`` per buffer. Not ``buffer[loc] = k``
        (``index_put_``): on CPU that opens an OpenMP parallel region even for a few rows, which on shared cores waits
        for descheduled threads (BENCHMARKS.md, "What makes it fast"). Duplicate slots: one wins. An FP8 cache stores
        :func:`quantize_fp8` of them (the caller's tensors are left as they were, unlike SGLang's in-place divide);
        a float cache ignores the scales."""
        layer = self._check_layer(layer_id)
        if k.shape[0] != loc.shape[0] or v.shape[0] != loc.shape[0]:
            raise ValueError(f"KVPool.set_kv: {loc.shape[0]} slots but {k.shape[0]} K rows and {v.shape[0]} V rows")
        if self.is_fp8:
            _check_scales(k_scale, v_scale)
            k = quantize_fp8(k, k_scale, self.dtype).view(torch.uint8)
            v = quantize_fp8(v, v_scale, self.dtype).view(torch.uint8)
            self._k_store[layer].index_copy_(0, loc, k)
            self._v_store[layer].index_copy_(0, loc, v)
            return
        self._k[layer].index_copy_(0, loc, k.to(self.dtype))
        self._v[layer].index_copy_(0, loc, v.to(self.dtype))

    def _check_layer(self, layer_id: int) -> int:
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"KVPool: layer_id {layer_id} out of range [0, {self.num_layers})")
        return layer_id

    @property
    def available_slots(self) -> int:
        """Free token slots: the free pages' slots (a partly filled page is not free)."""
        return int(self._free_pages.numel()) * self.page_size

    @property
    def available_pages(self) -> int:
        return int(self._free_pages.numel())

    def alloc_pages(self, n: int) -> torch.Tensor:
        """Take the ``n`` oldest free pages (int64 page numbers, on the pool's device)."""
        if n < 0:
            raise ValueError(f"KVPool.alloc_pages: n must be >= 0, got {n}")
        if n > self.available_pages:
            raise KVPoolFullError(
                f"KV pool is full: the allocation needs {n} pages of {self.page_size} token slots, "
                f"{self.available_pages} of {self.num_pages} free; free finished requests' slots or build a "
                "larger KVPool"
            )
        taken, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        for page in taken.tolist():
            self._page_fill[page] = 0
        return taken.to(self.device)

    def alloc_slots(self, n: int) -> torch.Tensor:
        """Take the slots of ``n`` tokens laid out in whole pages: the ``ceil(n / page_size)`` oldest free pages'
        slots in order, the first ``n`` of them (with token slots, page size 1: the ``n`` oldest free slots)."""
        if n < 0:
            raise ValueError(f"KVPool.alloc_slots: n must be >= 0, got {n}")
        pages = -(-n // self.page_size)
        if pages > self.available_pages:
            raise KVPoolFullError(
                f"KV pool is full: the allocation needs {n} token slots, {self.available_slots} of "
                f"{self.num_slots} free; free finished requests' slots or build a larger KVPool"
            )
        taken = self.alloc_pages(pages)
        for i, page in enumerate(taken.tolist()):
            self._page_fill[page] = min(self.page_size, n - i * self.page_size)
        return self.page_slots(taken)[:n]

    def page_fill(self, page: int) -> int:
        """How many leading slots of ``page`` hold a token: where the next token of the page's last request goes,
        unless another request sharing the page (a branch of the same prefix) took that slot already."""
        return self._page_fill[page]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at slots ``src`` copied to ``dst``, as stored (FP8 bytes included): a shared partial
        page copied on write."""
        src, dst = src.to(self.device, torch.int64), dst.to(self.device, torch.int64)
        for store in (*self._k_store, *self._v_store):
            store.index_copy_(0, dst, store.index_select(0, src))

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """The slots of ``pages``, page after page, each page's in order."""
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages.to(torch.int64).unsqueeze(1) * self.page_size + offsets).reshape(-1)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return the pages holding ``slots`` to the back of the free list (SGLang's paged allocator frees the pages
        of the slots it is given; with token slots a page is a slot); double frees are refused."""
        cpu = slots.detach().to("cpu", torch.int64).reshape(-1)
        if cpu.numel() and (int(cpu.min()) < 0 or int(cpu.max()) >= self.num_slots):
            raise ValueError(f"KVPool.free_slots: slot out of range [0, {self.num_slots})")
        pages = cpu // self.page_size
        if self.page_size > 1:
            pages = torch.unique(pages)
        if torch.unique(pages).numel() < pages.numel() or bool(torch.isin(pages, self._free_pages).any()):
            raise ValueError("KVPool.free_slots: a slot is freed twice or was never allocated")
        self._free_pages = torch.cat([self._free_pages, pages])
        for page in pages.tolist():
            self._page_fill[page] = 0

    def alloc_request(self) -> int:
        if not self._free_requests:
            raise KVPoolFullError(
                f"KV pool has no free request slot (max_requests={self.max_requests}); "
                "free a finished request or build a larger KVPool"
            )
        index = next(iter(self._free_requests))
        del self._free_requests[index]
        return index

    def free_request(self, index: int) -> None:
        """Release a request slot; its token slots are the caller's to free (as in SGLang)."""
        if not self.is_live_request(index):
            raise ValueError(f"KVPool.free_request: request slot {index} is not allocated")
        self._free_requests[index] = None

    def is_live_request(self, index: int) -> bool:
        return 0 <= index < self.max_requests and index not in self._free_requests


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """One forward pass: which requests run, how many new tokens each brings, where they go (the fields:
    docs/plugin-guide.md); lengths that do not add up are refused."""

    forward_mode: ForwardMode
    kv_pool: KVCache
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: tuple[int, ...]
    prefix_lens_cpu: tuple[int, ...]
    extend_seq_lens_cpu: tuple[int, ...]
    tree_mask: torch.Tensor | None = None
    """Speculative trees only (``BackendCapabilities.tree_mask``): bool, on the cache's device, one
    ``[extend_len, extend_len]`` block per request, row-major and concatenated in request order; entry
    ``[j, k]`` is True when new token ``j`` may attend to new token ``k`` of its request. The prefix is always
    visible; a token that sees no key at all (its row all False, no prefix) gets an output of zeros. ``None``:
    causal among the new tokens, as in every other batch."""
    host_lengths_exact: bool = True
    """Whether ``seq_lens_cpu`` and ``prefix_lens_cpu`` are the lengths themselves (``True``: every eager batch of
    an engine whose host copies are exact) or only upper bounds of the device's ``seq_lens`` / ``prefix_lens``
    (``False``): a captured graph's batch, whose lengths change on the device between replays, or a speculative
    worker's whose host copy is a planning bound. ``extend_seq_lens_cpu`` is always exact. Only a backend that
    declares ``BackendCapabilities.cuda_graph`` is handed bounds (docs/graphs.md); every other one gets
    :meth:`with_exact_host_lengths`."""
    pages: torch.Tensor | None = field(default=None, repr=False)
    """The engine's own page table, where it keeps one in ``page_table``'s form (vLLM's block table): handed to the
    backend as :attr:`page_table` instead of one rebuilt from ``req_to_token``. ``None``: built at first use."""
    batch_size: int = field(init=False)
    num_new_tokens: int = field(init=False)
    extend_start_loc_cpu: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        b = len(self.seq_lens_cpu)
        starts = (0, *itertools.accumulate(self.extend_seq_lens_cpu))
        object.__setattr__(self, "batch_size", b)
        object.__setattr__(self, "num_new_tokens", starts[-1])
        object.__setattr__(self, "extend_start_loc_cpu", starts[:-1])
        if len(self.prefix_lens_cpu) != b or len(self.extend_seq_lens_cpu) != b:
            raise ValueError("ForwardBatch: the *_cpu length tuples differ in batch size")
        for p, e, s in zip(self.prefix_lens_cpu, self.extend_seq_lens_cpu, self.seq_lens_cpu, strict=True):
            if p + e != s:
                raise ValueError(f"ForwardBatch: prefix {p} + extend {e} != seq_len {s}")
            if p < 0 or e < 1:
                raise ValueError(f"ForwardBatch: a request needs prefix_len >= 0 and extend_len >= 1, got {p}, {e}")
        width = self.kv_pool.req_to_token.shape[1]
        if b and max(self.seq_lens_cpu) > width:
            raise ValueError(
                f"ForwardBatch: a request spans {max(self.seq_lens_cpu)} tokens, beyond req_to_token's {width} "
                "columns (a backend would read slots that were never recorded)"
            )
        for name in ("req_pool_indices", "seq_lens", "prefix_lens", "extend_seq_lens", "out_cache_loc"):
            n = starts[-1] if name == "out_cache_loc" else b
            if tuple(getattr(self, name).shape) != (n,):
                raise ValueError(f"ForwardBatch: {name} must have shape ({n},)")
        if self.forward_mode is ForwardMode.IDLE and b:
            raise ValueError("ForwardBatch: an IDLE batch has no requests")
        if self.forward_mode is not ForwardMode.IDLE and not b:
            raise ValueError(f"ForwardBatch: this {self.forward_mode.name} batch has no requests; use IDLE for none")
        if self.forward_mode is ForwardMode.DECODE and any(e != 1 for e in self.extend_seq_lens_cpu):
            raise ValueError("ForwardBatch: a DECODE batch brings exactly one new token per request")
        if self.tree_mask is not None:
            _check_tree_mask("ForwardBatch", self.forward_mode, self.extend_seq_lens_cpu, self.tree_mask)
        if b:
            self._check_on_device()

    def _check_on_device(self) -> None:
        """The device's rows and lengths against the table and the host's, as one device-side assert (no read on
        the host unless it fails, so no sync on a GPU): every row of ``req_to_token``, ``prefix + extend ==
        seq_lens``, ``extend_seq_lens`` the host's, and ``seq_lens`` the host's (or, where those are bounds,
        within them)."""
        device = self.seq_lens.device
        rows, seq = self.req_pool_indices, self.seq_lens
        host = torch.tensor((*self.seq_lens_cpu, *self.extend_seq_lens_cpu)).to(device, non_blocking=True)
        host_seq, host_extend = host[: self.batch_size], host[self.batch_size :]
        lengths = (seq == host_seq) if self.host_lengths_exact else (seq <= host_seq) & (seq >= host_extend)
        ok = (
            lengths.all()
            & (self.prefix_lens + self.extend_seq_lens == seq).all()
            & (self.extend_seq_lens == host_extend).all()
            & (rows.min() >= 0)
            & (rows.max() < self.kv_pool.req_to_token.shape[0])
        )
        try:
            torch._assert_async(ok, "ForwardBatch: its device tensors disagree with its host lengths or table")
        except RuntimeError:  # a CPU tensor: the assert ran now, so the batch may be read to name the entry
            raise ValueError(f"ForwardBatch: {self._first_disagreement()}") from None

    def _first_disagreement(self) -> str:
        """The first entry the device check refused, read on the host (only after the check failed)."""
        table_rows = self.kv_pool.req_to_token.shape[0]
        for i, row in enumerate(self.req_pool_indices.tolist()):
            if not 0 <= row < table_rows:
                return f"req_pool_indices[{i}] = {row} is not a row of req_to_token (rows 0 to {table_rows - 1})"
        device = zip(self.seq_lens.tolist(), self.prefix_lens.tolist(), self.extend_seq_lens.tolist(), strict=True)
        for i, (seq, prefix, extend) in enumerate(device):
            host_seq, host_extend = self.seq_lens_cpu[i], self.extend_seq_lens_cpu[i]
            if extend != host_extend:
                return f"extend_seq_lens[{i}] = {extend} on the device, {host_extend} in extend_seq_lens_cpu"
            if prefix + extend != seq:
                return f"request {i}: prefix_lens {prefix} + extend_seq_lens {extend} != seq_lens {seq} on the device"
            if self.host_lengths_exact and seq != host_seq:
                return f"seq_lens[{i}] = {seq} on the device, {host_seq} in seq_lens_cpu (host_lengths_exact=True)"
            if not self.host_lengths_exact and not extend <= seq <= host_seq:
                return f"seq_lens[{i}] = {seq} on the device, outside [{extend}, {host_seq}] (its host bounds)"
        return "its device tensors disagree with its host lengths or table"

    def with_exact_host_lengths(self) -> ForwardBatch:
        """This batch with exact host lengths, read from the device's ``seq_lens`` where the host's are bounds: one
        device-to-host read, on behalf of a backend that plans from exact host lengths (one that does not declare
        ``cuda_graph``); the batch itself where they are already exact."""
        if self.host_lengths_exact:
            return self
        seq: tuple[int, ...] = tuple(self.seq_lens.tolist())
        prefix = tuple(s - e for s, e in zip(seq, self.extend_seq_lens_cpu, strict=True))
        return dataclasses.replace(self, seq_lens_cpu=seq, prefix_lens_cpu=prefix, host_lengths_exact=True)

    @functools.cached_property
    def page_table(self) -> torch.Tensor:
        """``[batch_size, max_pages]`` int64: entry ``[i, n]`` is the page holding tokens ``n * page_size ..`` of
        request ``i`` (``req_to_token[req_pool_indices, ::page_size] // page_size``), for ``n`` below
        ``ceil(seq_lens[i] / page_size)``; later entries are undefined. Built on first use and kept on the batch,
        so every layer shares one table (with page size 1 it is the requests' slots); the engine's own where it
        handed one over (:attr:`pages`)."""
        if self.pages is not None:
            return self.pages
        size = self.kv_pool.page_size
        width = -(-max(self.seq_lens_cpu, default=0) // size)
        table = self.kv_pool.req_to_token.index_select(0, self.req_pool_indices.to(torch.int64))
        return table[:, : width * size : size].to(torch.int64) // size

    @classmethod
    def prepare(
        cls,
        kv_pool: KVPool,
        forward_mode: ForwardMode,
        requests: Iterable[Sequence[int]],
        tree_mask: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Allocate and record the new slots of each ``(req_pool_index, prefix_len, extend_len)``, then build the
        batch; everything is checked first, so a refusal (naming the request) leaves the pool as it was."""
        specs = [tuple(int(x) for x in r) for r in requests]
        if forward_mode is ForwardMode.IDLE and specs:
            raise ValueError(f"ForwardBatch.prepare: an IDLE batch takes no requests, got {len(specs)}")
        if forward_mode is not ForwardMode.IDLE and not specs:
            raise ValueError(f"ForwardBatch.prepare: a {forward_mode.name} batch needs requests; use IDLE")
        seen: set[int] = set()
        for spec in specs:
            if len(spec) != 3:
                raise ValueError(f"ForwardBatch.prepare: {spec} is not (req_pool_index, prefix_len, extend_len)")
            req, prefix, extend = spec
            where = f"ForwardBatch.prepare: request slot {req}"
            if not 0 <= req < kv_pool.max_requests:
                raise ValueError(f"{where} is out of range [0, {kv_pool.max_requests})")
            if not kv_pool.is_live_request(req):
                raise ValueError(f"{where} is not allocated; call kv_pool.alloc_request() first")
            if req in seen:
                raise ValueError(f"{where} appears twice in one batch")
            seen.add(req)
            if prefix < 0 or extend < 1:
                raise ValueError(f"{where}: need prefix_len >= 0 and extend_len >= 1, got {prefix}, {extend}")
            if forward_mode is ForwardMode.DECODE and extend != 1:
                raise ValueError(f"{where}: DECODE takes exactly one new token, got extend_len={extend}")
            if prefix + extend > kv_pool.max_context_len:
                raise ValueError(
                    f"{where}: prefix_len + extend_len = {prefix + extend} exceeds "
                    f"max_context_len={kv_pool.max_context_len}"
                )
        extend_lens = [e for _, _, e in specs]
        if tree_mask is not None:  # before the allocation, so a refused mask takes no slot
            tree_mask = tree_mask.to(device=kv_pool.device)
            _check_tree_mask("ForwardBatch.prepare", forward_mode, extend_lens, tree_mask)
        if kv_pool.page_size == 1:
            out_cache_loc = kv_pool.alloc_slots(sum(extend_lens))  # the one allocation: it raises before taking any
        else:
            out_cache_loc = _alloc_in_pages(kv_pool, specs)
        for (req, prefix, extend), loc in zip(specs, out_cache_loc.split_with_sizes(extend_lens), strict=True):
            kv_pool.req_to_token[req, prefix : prefix + extend] = loc
        return cls.from_lists(kv_pool, forward_mode, specs, out_cache_loc, tree_mask)

    @classmethod
    def from_lists(
        cls,
        kv_pool: KVCache,
        forward_mode: ForwardMode,
        requests: Sequence[Sequence[int]],
        out_cache_loc: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Build a batch whose slots are already allocated and recorded (no allocation here)."""
        reqs, prefix, extend = (tuple(int(r[i]) for r in requests) for i in range(3))
        seq = tuple(p + e for p, e in zip(prefix, extend, strict=True))
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=kv_pool.device)
        return cls(
            forward_mode=forward_mode,
            kv_pool=kv_pool,
            req_pool_indices=as_tensor(reqs),
            seq_lens=as_tensor(seq),
            prefix_lens=as_tensor(prefix),
            extend_seq_lens=as_tensor(extend),
            out_cache_loc=out_cache_loc.to(device=kv_pool.device, dtype=torch.int64),
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=extend,
            tree_mask=None if tree_mask is None else tree_mask.to(device=kv_pool.device),
        )


def _check_scales(k_scale: object, v_scale: object) -> None:
    """An FP8 write's scales: one finite number > 0 per layer (a tensor, even of one value per head, is refused:
    the contract's scales are per layer, as both engines keep them)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(
                f"KVPool.set_kv: {name} must be one finite number > 0 for the layer (an FP8 cache stores "
                f"saturate(k / {name})), got {safe_repr(scale)}; per-head scales are not part of the contract"
            )


def _alloc_in_pages(kv_pool: KVPool, specs: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """The new tokens' slots as SGLang's paged allocator lays them out: a request's tokens fill its last, partly
    filled page first (the page of its token ``prefix_len - 1``), then new pages, each in order.

    A partly filled page may be shared: speculative branches copy their parent's request row, prefix slots and all,
    so the parent and every branch would fill the same free rest of one page and overwrite each other's K/V. The
    first to extend a page fills it in place (its fill is where its prefix ends); any other copies the page's
    prefix slots into a page of its own and goes on there (copy on write, as the engines do). The pages are counted
    first and taken in one allocation, so a refusal takes nothing."""
    size = kv_pool.page_size
    rows = kv_pool.req_to_token
    fill: dict[int, int] = {}  # the fills this batch leaves, before any is recorded
    plans = []  # (req, prefix, extend, the partly filled page or None, whether it is copied)
    need = 0
    for req, prefix, extend in specs:
        offset = prefix % size
        page = int(rows[req, prefix - 1]) // size if offset else None
        copied = page is not None and fill.get(page, kv_pool.page_fill(page)) != offset
        if page is not None and not copied:
            fill[page] = min(size, offset + extend)
        ahead = extend - (size - offset) if offset else extend  # the tokens past the partly filled page
        need += int(copied) + max(0, -(-ahead // size))
        plans.append((req, prefix, extend, page, copied))
    pages = kv_pool.alloc_pages(need).tolist()
    taken = 0
    locs: list[torch.Tensor] = []
    for req, prefix, extend, page, copied in plans:
        offset = prefix % size
        parts = []
        if page is not None:
            if copied:  # the shared page's prefix slots into a page of this request's own
                own = pages[taken]
                taken += 1
                old = torch.arange(page * size, page * size + offset, dtype=torch.int64)
                new = torch.arange(own * size, own * size + offset, dtype=torch.int64)
                kv_pool.copy_slots(old, new)
                rows[req, prefix - offset : prefix] = new.to(rows.device)
                page = own
            partial = min(extend, size - offset)
            parts.append(torch.arange(page * size + offset, page * size + offset + partial, dtype=torch.int64))
            kv_pool._page_fill[page] = offset + partial
        else:
            partial = 0
        count = max(0, -(-(extend - partial) // size))
        mine = pages[taken : taken + count]
        taken += count
        for i, fresh in enumerate(mine):
            kv_pool._page_fill[fresh] = min(size, extend - partial - i * size)
        parts.append(kv_pool.page_slots(torch.tensor(mine, dtype=torch.int64))[: extend - partial])
        locs.append(torch.cat(parts))
    if not locs:  # an IDLE batch
        return torch.zeros(0, dtype=torch.int64, device=kv_pool.device)
    return torch.cat(locs).to(kv_pool.device)


def _check_tree_mask(owner: str, mode: ForwardMode, extend_lens: Sequence[int], tree_mask: torch.Tensor) -> None:
    """Refuse a tree mask the batch cannot have: in a decode or idle batch, or not one bool block per request."""
    if mode.is_decode_or_idle():
        raise ValueError(f"{owner}: {mode.name} batches take no tree_mask (a tree is new tokens of an extend)")
    cells = sum(e * e for e in extend_lens)
    if tree_mask.dtype != torch.bool:  # never converted: an additive float mask (0 / -inf) read as bool inverts
        raise ValueError(
            f"{owner}: tree_mask must be a bool tensor (True: the token may attend), got {tree_mask.dtype}; an "
            "additive mask converts with mask == 0"
        )
    if tuple(tree_mask.shape) != (cells,):
        raise ValueError(
            f"{owner}: tree_mask must be a bool tensor of shape ({cells},) (one extend_len x extend_len "
            f"block per request), got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )
