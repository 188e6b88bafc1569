"""attnhost's :class:`~attnhost.KVCache` over SGLang's pools: views of SGLang's own tensors, never copies.

A backend reads and writes keys through one view per adapter. Three facts of the batch reach the view from the
adapter, through its public interface, before any layer runs: the slot table a speculative batch reads its keys
through (:attr:`SGLangKVCache.slot_table`, see ``batches.slot_table``), SGLang's mark that the batch's write slots
are physical ids (:attr:`SGLangKVCache.physical`), and, per layer, the ``RadixAttention`` object SGLang's pool
writes through (:meth:`SGLangKVCache.bind`).

The view reports SGLang's ``--page-size`` as its ``page_size`` (SGLang's paged allocator keeps ``req_to_token`` a
list of slots, page * size + offset, so ``ForwardBatch.page_table`` reads its pages) and an FP8 pool's float8
dtype, which the contract's write quantises into (docs/kv-cache.md).

SGLang's hybrid sliding-window pool (``SWAKVPool``) gets a second view for its window layers,
:class:`SGLangWindowKVCache`, whose slot table is the batch's translated into the window pool once per batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

from attnhost.dtypes import FP8_DTYPES, quantize_fp8

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

__all__ = ["SGLangKVCache", "SGLangWindowKVCache"]


class SGLangKVCache:
    """attnhost's :class:`~attnhost.KVCache` over SGLang's ``MHATokenToKVPool`` and ``ReqToTokenPool``."""

    __slots__ = ("_fp8", "_layers", "_pool", "_req_to_token_pool", "device", "page_size", "physical", "slot_table")

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool: MHATokenToKVPool, device: torch.device) -> None:
        self._req_to_token_pool = req_to_token_pool
        self._pool = token_to_kv_pool
        self._layers: dict[int, RadixAttention] = {}
        self.physical = False
        """SGLang's mark on the batch (``out_cache_loc_is_physical``): its write slots are physical ids."""
        self.slot_table: torch.Tensor | None = None
        """The batch's own slot table, which ``req_to_token`` then is; ``None``: SGLang's request table."""
        self.device = device
        # SGLang's paged allocator (--page-size) keeps req_to_token a list of slots, slot = page * size + offset,
        # so the page size is all a backend needs to read pages (ForwardBatch.page_table)
        self.page_size = int(getattr(token_to_kv_pool, "page_size", 1) or 1)
        dtype = token_to_kv_pool.dtype
        self._fp8: torch.dtype | None = dtype if dtype in FP8_DTYPES else None

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self._pool.dtype
        return dtype

    @property
    def request_table(self) -> torch.Tensor:
        """SGLang's own request table (``req_to_token_pool.req_to_token``), whatever slot table the view reads."""
        table: torch.Tensor = self._req_to_token_pool.req_to_token
        return table

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.request_table if self.slot_table is None else self.slot_table

    def take_mark(self, forward_batch: Any) -> None:
        """Take SGLang's physical-id mark from the batch about to run (see :attr:`physical`)."""
        self.physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))

    def bind(self, layer: RadixAttention) -> None:
        """The SGLang layer object ``set_kv`` hands SGLang's pool for its layer id (either of an MLA layer's two)."""
        self._layers[layer.layer_id] = layer

    def k_buffer(self, layer_id: int) -> torch.Tensor:
        buffer: torch.Tensor = self._pool.get_key_buffer(layer_id)
        return buffer

    def v_buffer(self, layer_id: int) -> torch.Tensor:
        buffer: torch.Tensor = self._pool.get_value_buffer(layer_id)
        return buffer

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """An FP8 cache gets the contract's write (``quantize_fp8``: divided and saturated, in fresh tensors), which
        SGLang's pool then stores as it is; given the scales, SGLang would divide the caller's ``k`` and ``v`` in
        place (which the backend may still read) and cast without saturating."""
        fp8 = self._fp8
        if fp8 is not None:
            k, v = quantize_fp8(k, k_scale, fp8), quantize_fp8(v, v_scale, fp8)
        self._pool.set_kv_buffer(self._layers[layer_id], self._write_loc(loc), k, v)

    def _write_loc(self, loc: torch.Tensor) -> KVWriteLoc:
        """Where SGLang's pool writes slots ``loc`` (the full pool's own slots)."""
        return KVWriteLoc(loc, physical=self.physical)


class SGLangWindowKVCache(SGLangKVCache):
    """The window layers' side of SGLang's hybrid ``SWAKVPool``: their buffers (the pool's own dispatch by layer)
    and, as ``req_to_token``, the batch's slot table translated into the window pool (:meth:`translate`), with
    the batch's rows in order; slots are window-pool slots throughout, writes included."""

    __slots__ = ()

    def translate(self, table: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``table``'s rows ``rows`` (their first ``width`` slots, full-pool slots) as window-pool slots, kept as
        this view's ``req_to_token``: once per batch, before any layer runs. A slot outside a request's window
        may map to SGLang's dummy slot or to a reused one; a backend that honours the window never reads it."""
        full = table.index_select(0, rows.to(torch.int64))[:, :width]
        translated: torch.Tensor = self._pool.translate_loc_from_full_to_swa(full)
        self.slot_table = translated
        return translated

    def _write_loc(self, loc: torch.Tensor) -> KVWriteLoc:
        """The slots are already window-pool slots: SGLang's pool must not translate them again."""
        return KVWriteLoc(loc, swa_loc=loc, physical=self.physical)
