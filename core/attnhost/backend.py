"""The contract every attention backend implements, and the layer it is called for.

Kept free of a module-level torch import: plugins subclass
``AttentionBackend`` at import time, and discovery must not pay for torch.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attnhost.forward_mode import ForwardMode

if TYPE_CHECKING:
    import torch

    from attnhost.forward_batch import ForwardBatch
    from attnhost.runner import ModelRunner

__all__ = ["AttentionBackend", "AttentionLayer"]


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """The per-layer facts a backend needs (SGLang's ``RadixAttention`` fields).

    ``q`` has ``num_heads`` heads, ``k``/``v`` have ``num_kv_heads``; when
    ``num_kv_heads < num_heads`` consecutive groups of query heads share one
    KV head (GQA; MQA when it is 1).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layer {self.layer_id}: head counts and head_dim must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.layer_id}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.scaling <= 0:
            object.__setattr__(self, "scaling", 1.0 / math.sqrt(self.head_dim))


class AttentionBackend(abc.ABC):
    """Base class of attention backends: SGLang's ``AttentionBackend`` surface.

    A backend is built by its factory as ``factory(runner)`` (a subclass is its
    own factory), once per model runner, and never shared between runners.
    The runner stamps the two ``*_attention_backend_str`` attributes on the
    instance so per-forward dispatch can tell which kernels this runner chose
    without reading any global (SGLang #28559).

    Tensors: ``q`` is ``[tokens, num_heads, head_dim]``, ``k``/``v`` are
    ``[tokens, num_kv_heads, head_dim]`` for the new tokens of the batch, in
    request order; the result is ``[tokens, num_heads, head_dim]``.
    """

    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None

    def __init__(self, runner: ModelRunner | None = None) -> None:  # noqa: B027 - optional to override
        """Accept the runner so a subclass is a valid factory; the base keeps nothing."""

    @abc.abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-batch metadata once, before the layers run."""

    @abc.abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for new tokens that attend to a cached prefix and causally to each other."""

    @abc.abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for one new token per request over its whole cached sequence."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Route by forward mode: idle gives an empty result, decode decodes, the rest extend."""
        mode = forward_batch.forward_mode
        if mode is ForwardMode.IDLE:
            return q.new_empty((0, layer.num_heads, layer.head_dim))
        if mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
