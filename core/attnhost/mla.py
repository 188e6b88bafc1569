"""Multi-head latent attention (MLA: DeepSeek V2/V3/R1, Kimi K2) in the backend contract: the facts of an MLA
model and the two forms in which it calls a backend (shapes and rules: docs/mla.md). Torch-free, like the contract
it extends: plugins import it at discovery time.

The cache of an MLA model holds one *latent* row per token, ``kv_lora_rank + qk_rope_head_dim`` wide, under one
KV head; keys are the whole row and values its first ``kv_lora_rank`` columns, exactly SGLang's
``MLATokenToKVPool``, so an engine's cache is passed as it is. Two forms read or feed it:

* ``MLAForm.MHA`` (prefill without a cached prefix): the model has decompressed keys and values per head, so the
  layer is plain multi-head attention whose V head dim differs from its QK head dim; the backend attends over the
  ``k``/``v`` arguments, and the *caller* writes the latent (the backend cannot derive it from ``k``/``v``).
* ``MLAForm.ABSORBED`` (everything else): the key up-projection is absorbed into the queries, so every query head
  attends over the cached latent rows through one shared KV head (MQA), with queries ``kv_lora_rank +
  qk_rope_head_dim`` wide and outputs ``kv_lora_rank`` wide.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["MLAConfig", "MLAForm"]


class MLAForm(enum.Enum):
    """Which of the two MLA call forms a layer object stands for."""

    MHA = "mha"
    """Decompressed per-head K/V from the arguments (``num_kv_heads == num_heads``); the cache is not touched."""
    ABSORBED = "absorbed"
    """Absorbed queries over the cached latent rows (one KV head); new latent rows are written when asked."""


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """The latent-attention facts of a model (DeepSeek's config names), shared by both forms of a layer."""

    kv_lora_rank: int
    """Width of the compressed latent: the values' width in the absorbed form (512 in DeepSeek V3)."""
    qk_rope_head_dim: int
    """Width of the rotary part of each key, stored after the latent in the same row (64 in V3; may be 0)."""
    qk_nope_head_dim: int
    """Width of the non-rotary part of each decompressed query/key head (128 in V3)."""
    v_head_dim: int
    """Width of each decompressed value head: the MHA form's output head dim (128 in V3)."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value, least = getattr(self, name), 0 if name == "qk_rope_head_dim" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"MLAConfig: {name} must be an integer >= {least}, got {value!r}")

    @property
    def latent_dim(self) -> int:
        """Width of one cached row (``kv_lora_rank + qk_rope_head_dim``): the absorbed form's QK head dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Width of a decompressed query/key head (``qk_nope_head_dim + qk_rope_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def default_scaling(self) -> float:
        """``1/sqrt(qk_head_dim)``: the model's softmax scale, which the absorbed form keeps although its queries
        are wider (absorbing the key projection changes no score)."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    def shape(self, form: MLAForm, num_heads: int) -> tuple[int, int, int]:
        """``(num_kv_heads, head_dim, v_head_dim)`` of a layer in ``form``."""
        if form is MLAForm.ABSORBED:
            return 1, self.latent_dim, self.kv_lora_rank
        return num_heads, self.qk_head_dim, self.v_head_dim

    def shape_problem(self, layer_id: int, form: MLAForm, got: tuple[int, int, int], num_heads: int) -> str | None:
        """Why a layer's ``(num_kv_heads, head_dim, v_head_dim)`` do not fit ``form``, or ``None`` when they do."""
        expected = self.shape(form, num_heads)
        if form is MLAForm.ABSORBED:
            label = "num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim, v_head_dim kv_lora_rank"
        else:
            label = "num_kv_heads num_heads, head_dim qk_nope + qk_rope, v_head_dim the config's v_head_dim"
        if got == expected:
            return None
        return (
            f"layer {layer_id}: an MLA layer in the {form.value} form has (num_kv_heads, head_dim, v_head_dim) = "
            f"{expected} ({label}), got {got}; build it with AttentionLayer.for_mla()"
        )
