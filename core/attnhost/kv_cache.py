"""The token-slot KV cache as backends see it: below both the backend contract and the batch that carries it, so
neither imports the other's module to name it (and no torch at run time: plugins import the contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["KVCache"]


class _OnDevice(Protocol):
    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


class KVCache(_OnDevice, Protocol):
    """The token-slot KV cache a backend reads and writes, whoever owns it (members: docs/plugin-guide.md).
    :class:`~attnhost.forward_batch.KVPool` is one; the engine bridges wrap SGLang's and vLLM's own caches without
    copying a byte, so rely on exactly this: the K/V buffers may be *strided* views (index, never ``view`` them)."""

    @property
    def req_to_token(self) -> torch.Tensor: ...

    @property
    def page_size(self) -> int:
        """Tokens per page the cache was allocated in (1: token slots): a request's tokens fill its pages in order,
        so token ``p``'s slot is ``page * page_size + p % page_size`` (``ForwardBatch.page_table`` lists the pages)."""
        ...

    def k_buffer(self, layer_id: int) -> torch.Tensor: ...

    def v_buffer(self, layer_id: int) -> torch.Tensor: ...

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write K/V at slots ``loc``; an FP8 cache stores ``saturate(k / k_scale)`` (docs/kv-cache.md), a float one
        ignores the scales."""
        ...
