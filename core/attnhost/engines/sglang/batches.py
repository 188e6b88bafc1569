"""SGLang's ``ForwardBatch`` as an attnhost :class:`~attnhost.ForwardBatch`: extend, decode, verify, draft.

Once per batch, before any layer runs, :class:`SGLangBatches` refuses what no attnhost batch expresses, checks the
batch without a host sync (``batch_checks``: the host's lengths on the host, the device's on the device) and builds
the attnhost batch over the adapter's KV view:

* EXTEND, MIXED and DECODE read their keys through SGLang's ``req_to_token``, on the scheduler's host copies of the
  lengths (exact for these batches); a decode batch without a host copy (a captured graph's) has the request
  table's width as bounds.
* TARGET_VERIFY (each request's draft tokens after its committed prefix; a tree's ``custom_mask`` becomes the
  contract's ``tree_mask``) and DRAFT_EXTEND_V2 read their keys through a per-batch slot table
  (:func:`slot_table`), since SGLang's own backends take the new tokens' K/V from the write slots, not from
  ``req_to_token``. The committed lengths of a verify are the device's, never read on the host.
* The draft's multi-step decode steps (``multistep``) are decode batches over the round's slot table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangForwardMode
from torch import Tensor

from attnhost.engines.batch_checks import check_device_batch, check_host_lengths
from attnhost.errors import InvalidBatchError
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch

    from attnhost.engines.identity import BackendIdentity
    from attnhost.engines.sglang.kv_views import SGLangKVCache

__all__ = ["SGLangBatches", "host_ints", "slot_table", "tree_blocks"]

_MODES = {
    SGLangForwardMode.EXTEND: ForwardMode.EXTEND,
    SGLangForwardMode.MIXED: ForwardMode.MIXED,
    SGLangForwardMode.DECODE: ForwardMode.DECODE,
    SGLangForwardMode.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
    SGLangForwardMode.DRAFT_EXTEND_V2: ForwardMode.DRAFT_EXTEND_V2,
}
_REFUSED_MODES = {
    SGLangForwardMode.SPLIT_PREFILL: "split prefill (PD multiplexing)",
    SGLangForwardMode.DLLM_EXTEND: "diffusion-LLM extend (bidirectional attention)",
    SGLangForwardMode.PREBUILT: "prebuilt (disaggregated decode) batches",
}


def host_ints(cpu: Any) -> tuple[int, ...]:
    """One of SGLang's host copies (a CPU tensor or a list) as ints: never a device read."""
    return tuple(int(n) for n in (cpu.tolist() if isinstance(cpu, Tensor) else cpu))


def slot_table(
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    prefix_lens: Tensor,
    prefix_bounds: tuple[int, ...],
    extend_cpu: tuple[int, ...],
    out_cache_loc: Tensor,
) -> Tensor:
    """The key slots of a speculative batch, one row per batch row: its request's first ``prefix_lens`` slots of
    ``req_to_token``, then the slots of its new tokens, which are ``out_cache_loc`` in order.

    SGLang's own backends read a speculative batch's new keys from the write slots (``k``/``v`` of the
    forward), not from ``req_to_token``, which may place them elsewhere (a tree's branches) or not yet at all;
    the contract's backends read every key through ``req_to_token``, so the adapter hands them this table.
    Two rows may name one request (the draft's tree branches share their prefix). The prefixes are the device's
    (``prefix_lens``), placed on the device, so no length is read on the host; the table's width comes from the
    host's bounds of them (``prefix_bounds``). It is built once per batch (a few hundred integers), never per layer.
    """
    width = max(p + e for p, e in zip(prefix_bounds, extend_cpu, strict=True))
    table = req_to_token.new_zeros((len(prefix_bounds), width))
    longest = min(max(prefix_bounds), req_to_token.shape[1])
    if longest:
        table[:, :longest] = req_to_token.index_select(0, req_pool_indices.to(torch.int64))[:, :longest]
    device = req_to_token.device
    # host lists to the device without a blocking copy (a blocking one waits for the stream on a GPU)
    rows = torch.tensor([row for row, e in enumerate(extend_cpu) for _ in range(e)]).to(device, non_blocking=True)
    steps = torch.tensor([j for e in extend_cpu for j in range(e)]).to(device, non_blocking=True)
    cols = prefix_lens.to(device=device, dtype=torch.int64).index_select(0, rows) + steps
    table.index_put_((rows, cols), out_cache_loc.to(device=device, dtype=table.dtype))
    return table


def tree_blocks(custom_mask: Tensor, committed: Tensor, draft_tokens: int) -> tuple[Tensor, Tensor | None]:
    """SGLang's verify ``custom_mask`` as the contract's ``tree_mask``: per request, the
    ``draft_tokens x draft_tokens`` block among the new tokens, concatenated, built on the device from the device's
    committed lengths; with it, for FULL_MASK, the device boolean "the mask's size fits the layout" (else ``None``).

    QLEN_ONLY (where SGLang's ``is_cpu()`` holds) already is that layout: ``draft_tokens**2`` entries a request.
    FULL_MASK (GPU-style platforms) holds, per request, ``draft_tokens`` rows of ``seq_len + draft_tokens``
    entries, the prefix columns first: the block is each row's tail. The size tells the two apart: they coincide
    only for empty prefixes, which a verify never has.
    """
    n, bs = draft_tokens, committed.numel()
    if custom_mask.numel() == bs * n * n:
        return custom_mask.to(torch.bool), None
    seq = committed.to(torch.int64).view(bs, 1, 1)
    rows = (seq + n) * n
    offset = rows.cumsum(0) - rows
    steps = torch.arange(n, device=committed.device)
    index = offset + steps.view(1, n, 1) * (seq + n) + seq + steps.view(1, 1, n)
    fits = rows.sum() == custom_mask.numel()
    index = index.clamp_(0, max(custom_mask.numel() - 1, 0)).view(-1)  # a misfit is refused by ``fits``, not read past
    return custom_mask.to(device=committed.device).index_select(0, index).to(torch.bool), fits


class SGLangBatches:
    """One adapter's translation of SGLang's batches, over its KV view (whose slot table it sets per batch)."""

    def __init__(self, identity: BackendIdentity, kv: SGLangKVCache, num_slots: int) -> None:
        self.identity = identity
        self.kv = kv
        self.num_slots = num_slots
        """How many slots ``out_cache_loc`` may name: a layer's buffer rows (the full pool's in a hybrid pool)."""

    @property
    def table_shape(self) -> tuple[int, int]:
        """SGLang's request table's rows and width."""
        rows, width = self.kv.request_table.shape
        return int(rows), int(width)

    def mode_of(self, forward_batch: SGLangBatch) -> ForwardMode:
        """The attnhost mode of a batch that is not idle, refusing what no attnhost batch expresses."""
        refuse = self.identity.refuse
        mode = forward_batch.forward_mode
        attnhost_mode = _MODES.get(mode)
        if attnhost_mode is None:
            raise refuse(_REFUSED_MODES.get(mode, f"forward mode {mode.name}"))
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise refuse("encoder tokens in the batch (cross-attention)")
        spec_info = forward_batch.spec_info
        if attnhost_mode is not ForwardMode.TARGET_VERIFY and getattr(spec_info, "custom_mask", None) is not None:
            raise refuse(f"custom attention masks in a {mode.name} batch (only target-verify carries a tree)")
        if attnhost_mode is ForwardMode.DECODE and getattr(spec_info, "topk", 1) > 1:
            # the draft's branch rows need the multi-step container
            raise refuse("speculative draft decode over tree branches outside its multi-step container")
        return attnhost_mode

    def translate(self, forward_batch: SGLangBatch, mode: ForwardMode) -> ForwardBatch:
        """The attnhost batch of a batch of ``mode`` (:meth:`mode_of`), checked."""
        if mode is ForwardMode.TARGET_VERIFY:
            return self._verify(forward_batch, forward_batch.spec_info)
        return self._extend_or_decode(forward_batch, mode)

    def _extend_or_decode(self, forward_batch: SGLangBatch, mode: ForwardMode) -> ForwardBatch:
        """EXTEND, MIXED, DECODE and DRAFT_EXTEND_V2, on the scheduler's host copies of the lengths (exact for
        these batches: SGLang's own kernels plan from them), checked against the device's on the device. A decode
        batch without a host copy is a captured graph's (SGLang's graph runners keep the lengths on the device
        only): its host lengths are the request table's width, as bounds."""
        seq_lens = forward_batch.seq_lens
        exact = True
        if mode is ForwardMode.DECODE:
            host = forward_batch.seq_lens_cpu
            if host is None:
                exact = False
                seq_cpu = (self.table_shape[1],) * forward_batch.batch_size
            else:
                seq_cpu = host_ints(host)
            prefix_lens = seq_lens - 1
            extend_lens = torch.ones_like(seq_lens)
            prefix_cpu = tuple(n - 1 for n in seq_cpu)
            extend_cpu = (1,) * len(seq_cpu)
        else:
            prefix_lens = forward_batch.extend_prefix_lens
            extend_lens = forward_batch.extend_seq_lens
            prefix_cpu = host_ints(forward_batch.extend_prefix_lens_cpu)
            extend_cpu = host_ints(forward_batch.extend_seq_lens_cpu)
            seq_cpu = tuple(p + e for p, e in zip(prefix_cpu, extend_cpu, strict=True))
        self.check(forward_batch, seq_lens, prefix_cpu, extend_cpu, exact, extend_cpu)
        if mode is ForwardMode.DRAFT_EXTEND_V2:
            # seq_lens already count the new tokens; they attend causally to the prefix and to each other, read
            # through a table of their own (the slots SGLang writes them to now), as SGLang's backends do.
            return self._spec_batch(mode, forward_batch, seq_lens - extend_lens, prefix_cpu, extend_cpu, None, exact)
        self.kv.slot_table = None
        return self._batch_of(
            forward_mode=mode,
            kv_pool=self.kv,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens,
            out_cache_loc=forward_batch.out_cache_loc,
            seq_lens_cpu=seq_cpu,
            prefix_lens_cpu=prefix_cpu,
            extend_seq_lens_cpu=extend_cpu,
            host_lengths_exact=exact,
        )

    def check(
        self,
        forward_batch: SGLangBatch,
        device_lens: Tensor,
        prefix_cpu: tuple[int, ...],
        extend_cpu: tuple[int, ...],
        exact: bool,
        least: tuple[int, ...],
        write_slots: Tensor | None = None,
    ) -> None:
        """The batch's host lengths on the host, its slots, rows and ``device_lens`` on the device, without a read
        (``batch_checks``). ``device_lens`` are SGLang's ``seq_lens``: ``prefix + extend`` for an extend or a decode
        (equal to the host's where ``exact``, else within them and at least ``least``), the committed prefix for a
        verify or a draft round (within ``prefix_cpu``, the host's bounds). ``write_slots``: the slots a draft round
        writes, where ``out_cache_loc`` holds a wider window than its steps. (A graph batch, whose padded rows all
        write SGLang's slot 0, is checked by ``graphs.DecodeGraphs.refresh``.)"""
        where, engine_bug = self.identity.where, self.identity.engine_bug
        loc = forward_batch.out_cache_loc if write_slots is None else write_slots
        shape = self.table_shape
        count = loc.numel() if write_slots is None else sum(extend_cpu)
        check_host_lengths(where, prefix_cpu, extend_cpu, shape, count, engine_bug)
        committed = forward_batch.forward_mode.is_target_verify() or write_slots is not None
        check_device_batch(
            where,
            seq_lens=device_lens,
            out_cache_loc=loc,
            req_pool_indices=forward_batch.req_pool_indices,
            host_seq_lens=prefix_cpu
            if committed
            else tuple(p + e for p, e in zip(prefix_cpu, extend_cpu, strict=True)),
            host_lengths_exact=exact,
            extend_lens=least,
            num_slots=self.num_slots,
            num_rows=shape[0],
            way_out=engine_bug,
        )

    def _batch_of(self, **fields: Any) -> ForwardBatch:
        """An attnhost batch, its own consistency refusals (``ForwardBatch``) named as this backend's."""
        try:
            return ForwardBatch(**fields)
        except ValueError as exc:
            raise InvalidBatchError(
                f"{self.identity.where}: {exc}; nothing was read or written — {self.identity.engine_bug}"
            ) from None

    def _verify(self, forward_batch: SGLangBatch, spec_info: Any) -> ForwardBatch:
        """TARGET_VERIFY: each request's ``draft_token_num`` new tokens after its committed ``seq_lens``.

        The committed lengths are the device's, placed on the device and never read on the host: a speculative
        worker's host copy may be only a planning bound (DFLASH sets it to the committed length plus the block
        size), and attending to that many slots reads slots that hold nothing yet. The host copy (or, without
        one, the request table's width) becomes the batch's host bounds. Whether the new tokens form a chain or a
        tree is read from the mask the batch carries, never from an attribute some verify inputs lack (NGRAM's
        has no ``topk``): no ``custom_mask``, or one that is causal among the new tokens, is a chain; anything
        else a tree, for which SGLang's FULL_MASK (per request, ``draft_token_num`` rows of ``seq_len +
        draft_token_num`` booleans, GPU-style platforms) and QLEN_ONLY (``draft_token_num**2`` per request, where
        SGLang's ``is_cpu()`` holds) layouts both become the contract's per-request ``tree_mask`` blocks.
        """
        draft_tokens = int(getattr(spec_info, "draft_token_num", 0) or 0)
        if draft_tokens < 1:
            raise self.identity.refuse("a target-verify batch without draft_token_num (not an EAGLE verify input)")
        bs = forward_batch.batch_size
        most = self.table_shape[1] - draft_tokens  # the longest committed prefix the table leaves room for
        host = forward_batch.seq_lens_cpu
        bounds = (most,) * bs if host is None else tuple(min(n, most) for n in host_ints(host))
        extend = (draft_tokens,) * bs
        self.check(forward_batch, forward_batch.seq_lens, bounds, extend, False, (0,) * bs)
        tree_mask = self._tree_mask(getattr(spec_info, "custom_mask", None), forward_batch.seq_lens, spec_info)
        if tree_mask is not None and not self.identity.capabilities.tree_mask:
            raise self.identity.refuse(
                "speculative tree verify (this batch's custom_mask is a tree; it declares no tree_mask capability)",
                "run chains (--speculative-eagle-topk 1) or choose a backend that declares tree_mask",
            )
        return self._spec_batch(
            ForwardMode.TARGET_VERIFY, forward_batch, forward_batch.seq_lens, bounds, extend, tree_mask, False
        )

    def _tree_mask(self, custom_mask: Tensor | None, committed: Tensor, spec_info: Any) -> Tensor | None:
        """The verify batch's tree as the contract's blocks, or ``None`` for a chain: no mask, or an EAGLE chain
        (``topk == 1``), whose mask is causal. Without that word (NGRAM's and DFLASH's inputs have no ``topk``) a
        backend that declares ``tree_mask`` gets the mask whatever it holds (a causal one is a chain); for one that
        does not, whether it is causal is read from the mask, on its behalf."""
        if custom_mask is None:
            return None
        draft_tokens = int(spec_info.draft_token_num)
        blocks = self.blocks(custom_mask, committed, draft_tokens)
        topk = getattr(spec_info, "topk", None)
        if topk == 1:
            return None
        if topk is not None or self.identity.capabilities.tree_mask:
            return blocks
        causal = torch.ones(draft_tokens, draft_tokens, dtype=torch.bool, device=blocks.device).tril_()
        if torch.equal(blocks.view(-1, draft_tokens, draft_tokens), causal.expand(committed.numel(), -1, -1)):
            return None
        return blocks

    def blocks(self, custom_mask: Tensor, committed: Tensor, draft_tokens: int) -> Tensor:
        """SGLang's verify mask as the contract's blocks (:func:`tree_blocks`), refused where it is no bool mask or
        fits no layout SGLang makes (checked on the device: no read unless it fails)."""
        where, engine_bug = self.identity.where, self.identity.engine_bug
        if custom_mask.dtype != torch.bool or custom_mask.dim() != 1:
            raise InvalidBatchError(
                f"{where}: this verify batch's custom_mask is a {custom_mask.dim()}-D {custom_mask.dtype} "
                "tensor; SGLang's verify masks are flat bool tensors (True: the token may attend), and an additive "
                f"float mask read as booleans would invert it; nothing was read or written — {engine_bug}"
            )
        blocks, fits = tree_blocks(custom_mask, committed, draft_tokens)
        if fits is not None:
            try:
                torch._assert_async(fits, f"{where}: a verify custom_mask fits no layout SGLang makes")
            except RuntimeError:
                raise InvalidBatchError(
                    f"{where}: this verify batch's custom_mask ({custom_mask.numel()} entries) fits neither "
                    f"SGLang's QLEN_ONLY nor its FULL_MASK layout for {committed.numel()} requests of {draft_tokens} "
                    f"draft tokens (draft_token_num); nothing was read or written — {engine_bug}"
                ) from None
        return blocks

    def draft_step(
        self,
        table: Tensor,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        out_cache_loc: Tensor,
        step: int,
    ) -> ForwardBatch:
        """Draft decode step ``step`` of a multi-step round (``multistep``): row ``r`` of ``table`` has its prefix
        and branch slots, and reads its first ``prefix_lens[r] + step + 1`` (the device's prefix, within the
        host's ``prefix_bounds``)."""
        self.kv.slot_table = table
        bounds = tuple(p + step for p in prefix_bounds)
        return self._table_batch(
            ForwardMode.DECODE, prefix_lens + step, bounds, (1,) * len(bounds), out_cache_loc, None, False
        )

    def _spec_batch(
        self,
        mode: ForwardMode,
        forward_batch: SGLangBatch,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        extend_cpu: tuple[int, ...],
        tree_mask: Tensor | None,
        exact: bool,
    ) -> ForwardBatch:
        """A speculative batch over its own slot table (see :func:`slot_table`): row ``i`` is request ``i``."""
        out_cache_loc = forward_batch.out_cache_loc
        self.kv.slot_table = slot_table(
            self.kv.request_table,
            forward_batch.req_pool_indices,
            prefix_lens,
            prefix_bounds,
            extend_cpu,
            out_cache_loc,
        )
        return self._table_batch(mode, prefix_lens, prefix_bounds, extend_cpu, out_cache_loc, tree_mask, exact)

    def _table_batch(
        self,
        mode: ForwardMode,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        extend_cpu: tuple[int, ...],
        out_cache_loc: Tensor,
        tree_mask: Tensor | None,
        exact: bool,
    ) -> ForwardBatch:
        """A batch whose row ``i`` is row ``i`` of the view's slot table, its lengths the device's ``prefix_lens``
        plus the host's exact ``extend_cpu`` (host lengths: ``prefix_bounds``, exact or bounds)."""
        device = prefix_lens.device
        prefix = prefix_lens.to(torch.int64)
        extend = torch.tensor(extend_cpu, dtype=torch.int64).to(device, non_blocking=True)
        return self._batch_of(
            forward_mode=mode,
            kv_pool=self.kv,
            req_pool_indices=torch.arange(len(prefix_bounds), dtype=torch.int64, device=device),
            seq_lens=prefix + extend,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            out_cache_loc=out_cache_loc.to(torch.int64),
            seq_lens_cpu=tuple(p + e for p, e in zip(prefix_bounds, extend_cpu, strict=True)),
            prefix_lens_cpu=prefix_bounds,
            extend_seq_lens_cpu=extend_cpu,
            tree_mask=tree_mask,
            host_lengths_exact=exact,
        )
