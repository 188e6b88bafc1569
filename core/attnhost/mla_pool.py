"""attnhost's own latent KV cache for MLA models: SGLang's ``MLATokenToKVPool`` semantics on attnhost's token-slot
pool, so runners, tests and benchmarks exercise exactly what the engine bridges pass."""

from __future__ import annotations

import torch

from attnhost.kv_pool import KVPool
from attnhost.mla import MLAConfig

__all__ = ["MLAKVPool"]


class MLAKVPool(KVPool):
    """One latent row per token slot and layer: ``k_buffer`` is ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``,
    ``v_buffer`` its first ``kv_lora_rank`` columns as a strided view (no second copy, as in SGLang), and
    ``set_kv`` writes whole rows. Slot and request allocation are :class:`KVPool`'s."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        mla: MLAConfig,
        *,
        max_requests: int,
        max_context_len: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        table_dtype: torch.dtype = torch.int64,
    ) -> None:
        super().__init__(
            num_layers,
            num_slots,
            1,
            mla.latent_dim,
            max_requests=max_requests,
            max_context_len=max_context_len,
            dtype=dtype,
            device=device,
            page_size=page_size,
            table_dtype=table_dtype,
        )
        if self.is_fp8:
            raise ValueError(
                f"MLAKVPool: a latent cache of {self.dtype} is not part of the contract (MLA caches hold the model's "
                "dtype; engines refuse a quantized latent cache too); build it with the model's dtype"
            )
        self.mla = mla
        self._v = [row[..., : mla.kv_lora_rank] for row in self._k]  # the separate V buffers are dropped

    def set_kv(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write the new tokens' latent rows ``k`` (``[n, 1, latent_dim]`` or ``[n, latent_dim]``) at slots
        ``loc``; ``v`` is ignored, as V is the rows' first ``kv_lora_rank`` columns (``MLATokenToKVPool``). The
        scales too: a latent cache is never FP8 (the runner refuses it)."""
        layer = self._check_layer(layer_id)
        width = self.mla.latent_dim
        if k.shape[0] != loc.shape[0] or k.shape[-1] != width or k.numel() != loc.shape[0] * width:
            raise ValueError(
                f"MLAKVPool.set_kv: {loc.shape[0]} slots need latent rows of shape ({loc.shape[0]}, 1, {width}) "
                f"(kv_lora_rank {self.mla.kv_lora_rank} + qk_rope_head_dim {self.mla.qk_rope_head_dim}), "
                f"got {tuple(k.shape)}"
            )
        self._k[layer].index_copy_(0, loc, k.reshape(-1, 1, width).to(self.dtype))
