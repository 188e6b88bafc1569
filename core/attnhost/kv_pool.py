"""The host's KV pool: per-layer K/V buffers by token slot and the request-to-slot table, allocated in pages as
SGLang's allocator does. What an engine keeps, not what a backend implements: a backend reads any cache through the
:class:`attnhost.kv_cache.KVCache` protocol, of which this pool (the runners' and the kit's) is one.

SGLang's layout: every cached token owns one *slot* in a per-layer K and V buffer, and ``req_to_token`` maps (request
slot, position) to it; slots come in pages of ``page_size`` (1: token slots), and the buffers may be FP8, written by
the quantising write (docs/kv-cache.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attnhost.dtypes import FP8_DTYPES, check_size, quantize_fp8, resolve_kv_cache_dtype
from attnhost.errors import KVPoolFullError, safe_repr

__all__ = ["KVPool"]


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

    def alloc_batch(self, specs: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """Allocate the new tokens' slots of each checked ``(req_pool_index, prefix_len, extend_len)`` and record
        them in ``req_to_token``: one allocation, which raises before taking any slot (:meth:`ForwardBatch.prepare`
        checks the requests first)."""
        extend_lens = [extend for _, _, extend in specs]
        paged = self.page_size > 1
        out_cache_loc = _alloc_in_pages(self, specs) if paged else self.alloc_slots(sum(extend_lens))
        for (req, prefix, extend), loc in zip(specs, out_cache_loc.split_with_sizes(extend_lens), strict=True):
            self.req_to_token[req, prefix : prefix + extend] = loc
        return out_cache_loc


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
