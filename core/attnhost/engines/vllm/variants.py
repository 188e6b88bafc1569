"""The attention variants vLLM hands an impl (sliding window, logit soft-cap, sinks, non-causal) as attnhost's.

vLLM asks for them in two places, and attnhost answers in both from what the
backend declares (``BackendCapabilities``), so a layer that needs a variant the
backend lacks is refused while vLLM builds the model, never on a batch:

* vLLM's selector, through the backend class (``supports_sink``,
  ``supports_sliding_window``, ``supports_non_causal``, ``supports_attn_type``,
  then ``validate_configuration``), for what the selector knows of a layer;
* the impl's constructor, for the values themselves (the soft-cap reaches
  only it) and for a layer built with a fixed backend class, which bypasses
  the selector.

The conventions differ in one place: vLLM's ``sliding_window`` is HF's ``W``
(a query sees ``W`` keys, itself included), attnhost's ``sliding_window_size``
is ``W - 1`` (docs/variants.md). vLLM's own kernels make a window on a
non-causal batch symmetric (``W - 1`` keys on each side) while attnhost's
contract limits only the left side, so that pair is refused rather than
computed with another meaning. (Encoder-only layers stay refused with the other
attention types: vLLM keeps no KV cache for them, and attnhost backends read
their keys from the cache.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_current_vllm_config_or_none

from attnhost.backend import AttentionLayer, BackendCapabilities

if TYPE_CHECKING:
    from attnhost.engines.identity import BackendIdentity
    from attnhost.errors import UnsupportedFeatureError

__all__ = ["WINDOWED_NON_CAUSAL", "LayerVariants", "explain_reason", "layer_variants", "refuse_non_causal"]

WINDOWED_NON_CAUSAL = (
    "a sliding window on a non-causal batch (vLLM's kernels limit both sides there, attnhost's contract the left "
    "side only)"
)
"""Why the adapter refuses a window together with non-causal attention, in vLLM's selector and on a batch."""

_DECLARES = {
    "attention sinks not supported": "sinks",
    "sliding window not supported": "sliding_window",
    "non-causal attention not supported": "non_causal",
}
"""vLLM's selector reasons that one of attnhost's capability flags answers, and the flag."""


def explain_reason(reason: str, capabilities: BackendCapabilities) -> str | None:
    """vLLM's selector reason with the flag the backend would have to declare, when a variant flag answers it."""
    flag = _DECLARES.get(reason)
    if flag is None:
        return None
    if getattr(capabilities, flag):  # declared, yet refused: the only such case is an MLA name
        return f"{reason}: attnhost's MLA forms are plain causal attention"
    return f"{reason}: it does not declare BackendCapabilities.{flag}"


@dataclass(frozen=True, slots=True)
class LayerVariants:
    """One vLLM layer's variants in attnhost's terms: the layers the impl runs and the sinks it passes per call."""

    layer: AttentionLayer
    """The layer as a causal batch runs it."""
    bidirectional: AttentionLayer | None
    """The same layer for a non-causal batch (vLLM's ``causal=False``), or ``None`` when the backend does not
    declare ``non_causal`` or the layer has a window."""
    sinks: torch.Tensor | None
    """vLLM's ``[num_heads]`` sink logits (the model's own parameter, so weight loading reaches it), or ``None``."""


def layer_variants(
    identity: BackendIdentity,
    layer_id: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: Any,
) -> LayerVariants:
    """The attnhost layer for vLLM's impl arguments, refusing (one error naming backend, model and feature) what
    the backend does not declare and what vLLM means differently."""
    refuse = identity.refuse
    in_model = _in_model()
    window = -1
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise refuse(f"vLLM sliding_window={sliding_window!r}{in_model} (a window is a number of keys >= 1)")
        window = sliding_window - 1
    cap = 0.0
    if logits_soft_cap:
        if isinstance(logits_soft_cap, bool) or not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
            raise refuse(f"vLLM logits_soft_cap={logits_soft_cap!r}{in_model} (a cap is a finite number > 0)")
        cap = float(logits_soft_cap)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != num_heads:
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise refuse(f"attention sinks of shape {shape}{in_model} (one logit per query head: ({num_heads},))")
        if not sinks.dtype.is_floating_point:
            raise refuse(f"attention sinks of dtype {sinks.dtype}{in_model} (sinks are floating-point logits)")
    layer = AttentionLayer(
        layer_id=layer_id,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        scaling=scale,
        sliding_window_size=window,
        logit_cap=cap,
        has_sinks=sinks is not None,
    )
    reason = identity.capabilities.layer_refusal(layer)
    if reason is not None:
        asked = {
            "sliding_window": f"sliding_window={sliding_window}",
            "logit_cap": f"logits_soft_cap={logits_soft_cap}",
            "sinks": "sinks",
        }
        vllm_words = ", ".join(asked[feature] for feature in layer.variant_features)
        raise refuse(f"{reason}{in_model}, asked by vLLM as {vllm_words}")
    bidirectional = None
    if identity.capabilities.non_causal and window < 0:
        bidirectional = AttentionLayer(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_size,
            scaling=scale,
            logit_cap=cap,
            has_sinks=sinks is not None,
            is_causal=False,
        )
    return LayerVariants(layer, bidirectional, sinks)


def refuse_non_causal(identity: BackendIdentity, variants: LayerVariants) -> UnsupportedFeatureError:
    """Why a non-causal batch cannot run this layer (the selector refuses it first; this is the last guard)."""
    if variants.layer.sliding_window_size >= 0 and identity.capabilities.non_causal:
        return identity.refuse(WINDOWED_NON_CAUSAL)
    return identity.refuse(
        "non-causal (bidirectional) attention (it does not declare non_causal)",
        "choose a backend that declares BackendCapabilities.non_causal",
    )


def _in_model() -> str:
    """`` in model 'NAME'`` while vLLM builds a model (its current config names it), else nothing."""
    config = get_current_vllm_config_or_none()
    model = getattr(getattr(config, "model_config", None), "model", None)
    return f" in model {model!r}" if model else ""
