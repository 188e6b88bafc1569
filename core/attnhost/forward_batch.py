"""The per-forward batch that attention backends read: which requests run, how many new tokens each brings and
where they go, over a KV cache (:class:`attnhost.kv_cache.KVCache`). Its lengths are mirrored as ints, so per-layer
code never syncs with the device for a shape. The host side that allocates the slots is :mod:`attnhost.kv_pool`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache

if TYPE_CHECKING:
    from attnhost.kv_pool import KVPool

__all__ = ["ForwardBatch"]


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
        out_cache_loc = kv_pool.alloc_batch(specs)
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
