"""What an SGLang model asks of its attention: each layer's facts, and the loaded model walked once at start-up.

Each ``RadixAttention`` becomes an attnhost :class:`~attnhost.AttentionLayer` once (:func:`layer_facts`): its
``sliding_window_size``, ``logit_cap`` (tanh only), ``attn_type`` (``ENCODER_ONLY``: non-causal), sinks and K/V
scales; what the attnhost contract cannot express (cross-attention, other logit caps, a V head dim unlike the QK
one) is refused there, naming the backend and the feature.

SGLang's ``ModelRunner.initialize`` loads the model before it builds the attention backends, so the adapter can
walk the model's ``RadixAttention`` modules then, once, and refuse a layer whose variants (window, soft-cap,
sinks, non-causal) the attnhost backend does not declare at start-up, where the engine hands the error to the
caller, instead of on the first batch, inside a scheduler whose death the caller sees only as a killed process.

Sinks are not a ``RadixAttention`` field: a model passes them per call (``sinks=``, gpt-oss), from a tensor its
attention module owns beside the ``RadixAttention`` (``GptOssAttention.sinks`` next to ``.attn``), so that is
what marks a layer as having them.

A config may also declare a window that SGLang's model code drops (Mistral v0.1 and Qwen2 build every layer
without one), in which case every backend, SGLang's own included, computes full attention where HF transformers
slides: :func:`dropped_window` words the one warning for that.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention

from attnhost.backend import AttentionLayer, dtype_name
from attnhost.errors import UnsupportedFeatureError

if TYPE_CHECKING:
    from attnhost.engines.identity import BackendIdentity

__all__ = [
    "attention_layers",
    "check_model",
    "dropped_window",
    "layer_facts",
    "model_name",
    "refuse_variants",
    "variant_way_out",
    "warn_once_per_runner",
]

logger = logging.getLogger("attnhost.engines.sglang")

_warned: weakref.WeakSet[Any] = weakref.WeakSet()

Peers = Callable[[tuple[str, ...]], list[str]]
"""The exported attnhost backends (engine names) that declare every one of the given capability flags."""


def attention_layers(model: Any) -> Iterator[tuple[RadixAttention, bool]]:
    """Each ``RadixAttention`` of *model* once, with whether the module holding it also holds ``sinks``."""
    seen: set[int] = set()
    for module in model.modules():
        sinks = isinstance(getattr(module, "sinks", None), torch.Tensor)
        for child in module.children():
            if isinstance(child, RadixAttention) and id(child) not in seen:
                seen.add(id(child))
                yield child, sinks


def model_name(runner: Any) -> str:
    """The runner's model for messages: ``GptOssForCausalLM (/models/gpt-oss)``."""
    config = getattr(runner, "model_config", None)
    architectures = getattr(getattr(config, "hf_config", None), "architectures", None) or []
    name = architectures[0] if architectures else type(getattr(runner, "model", None)).__name__
    path = getattr(config, "model_path", None)
    return f"{name} ({path})" if path else str(name)


def dropped_window(runner: Any, windows: list[int]) -> str | None:
    """The warning for a model whose config declares a sliding window (``sliding_window`` set, and for Qwen2
    ``use_sliding_window`` true) that none of its attention layers carries (*windows*: their
    ``sliding_window_size``), or ``None``."""
    config = getattr(runner, "model_config", None)
    hf = getattr(config, "hf_text_config", None) or getattr(config, "hf_config", None)
    window = getattr(hf, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or any(w >= 0 for w in windows):
        return None
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    context = getattr(config, "context_len", None)
    if isinstance(context, int) and window >= context:
        return None  # no sequence here is long enough for the window to matter
    return (
        f"{model_name(runner)} declares sliding_window={window} in its config, but SGLang's model code gives none "
        f"of its {len(windows)} attention layers a window, so every attention backend, SGLang's own included, "
        f"attends to all earlier tokens: outputs differ from HF transformers' once a sequence exceeds {window} tokens"
    )


def warn_once_per_runner(runner: Any) -> bool:
    """Whether this is the first warning for *runner* (a draft's multi-step container builds several adapters)."""
    try:
        if runner in _warned:
            return False
        _warned.add(runner)
    except TypeError:  # a runner that cannot be weakly referenced: warn every time rather than never
        pass
    return True


def layer_facts(
    identity: BackendIdentity, layer: RadixAttention, has_sinks: bool, dtype: torch.dtype
) -> AttentionLayer:
    """The attnhost view of a layer (``has_sinks``: whether its model passes it ``sinks=``), refusing what the
    contract cannot express or the backend cannot compute in ``dtype`` at its head dim."""
    refuse = identity.refuse
    if getattr(layer, "is_cross_attention", False):
        raise refuse(f"cross-attention (layer {layer.layer_id})")
    attn_type = getattr(getattr(layer, "attn_type", None), "name", "DECODER")
    if attn_type not in ("DECODER", "ENCODER_ONLY"):
        raise refuse(f"{attn_type.lower()} attention (layer {layer.layer_id})")
    cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
    method = getattr(layer, "logit_capping_method", "tanh")
    if cap > 0 and method != "tanh":
        raise refuse(f"the logit-capping method {method!r} (layer {layer.layer_id}; the contract's soft-cap is tanh)")
    if layer.qk_head_dim != layer.v_head_dim:
        raise refuse(f"a V head dim ({layer.v_head_dim}) unlike the QK head dim ({layer.qk_head_dim})")
    head_dim = layer.qk_head_dim
    reason = identity.capabilities.refusal(dtype=dtype_name(dtype), head_dim=head_dim)
    if reason is not None:
        raise refuse(reason)
    window = getattr(layer, "sliding_window_size", -1)
    return AttentionLayer(
        layer_id=layer.layer_id,
        num_heads=layer.tp_q_head_num,
        num_kv_heads=layer.tp_k_head_num,
        head_dim=head_dim,
        scaling=float(layer.scaling),
        sliding_window_size=-1 if window is None or window < 0 else int(window),
        logit_cap=cap,
        has_sinks=has_sinks,
        is_causal=attn_type == "DECODER",
        k_scale=_scale(identity, layer, "k"),
        v_scale=_scale(identity, layer, "v"),
    )


def _scale(identity: BackendIdentity, layer: RadixAttention, which: str) -> float:
    """The layer's K or V scale as a float (the contract's ``AttentionLayer.k_scale`` / ``v_scale``): SGLang's
    ``k_scale_float`` once its weights are loaded, else its one-element ``k_scale``; none is 1.0. A float cache
    ignores it; a per-head scale is no scale the contract knows, so it is refused."""
    value = getattr(layer, f"{which}_scale_float", None)
    if value is None:
        scale = getattr(layer, f"{which}_scale", None)
        if scale is None:
            return 1.0
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise identity.refuse(
                    f"a {which.upper()} scale of {scale.numel()} entries (layer {layer.layer_id}; the contract's "
                    "scale is one per layer)",
                    "use --kv-cache-dtype auto",
                )
            return float(scale.item())
        value = scale
    return float(value)


def variant_way_out(identity: BackendIdentity, needs: tuple[str, ...], peers: Peers) -> str:
    """The way out of a variant refusal: the exported attnhost backends that declare all of *needs*."""
    capable = [name for name in peers(needs) if name != identity.engine_name]
    flags = ", ".join(needs)
    if capable:
        return f"choose with {identity.flag} a backend that declares {flags}, e.g. {', '.join(capable)}"
    return f"choose with {identity.flag} a backend that declares {flags}"


def refuse_variants(identity: BackendIdentity, layer: AttentionLayer, peers: Peers) -> None:
    """Refuse a layer the start-up walk did not find (first seen on a forward) whose variants the backend does not
    declare (``BackendCapabilities.layer_refusal``)."""
    reason = identity.capabilities.layer_refusal(layer)
    if reason is not None:
        raise identity.refuse(
            f"{reason} (layer {layer.layer_id})", variant_way_out(identity, layer.variant_features, peers)
        )


def check_model(
    identity: BackendIdentity, runner: Any, dtype: torch.dtype, window_ids: frozenset[int], peers: Peers
) -> list[tuple[RadixAttention, AttentionLayer]]:
    """Every attention layer of the runner's loaded model with its facts, refusing, before any batch, one whose
    variants the backend does not declare (``BackendCapabilities.layer_refusal``) or one without a window among
    ``window_ids`` (the hybrid pool's window layers); warn once if the config declares a window no layer carries
    (Mistral v0.1, Qwen2: SGLang's model code drops it)."""
    model = getattr(runner, "model", None)
    if model is None:
        return []
    walked = []
    for radix, has_sinks in attention_layers(model):
        layer = layer_facts(identity, radix, has_sinks, dtype)
        walked.append((radix, layer))
        reason = identity.capabilities.layer_refusal(layer)
        if reason is not None:
            raise UnsupportedFeatureError(
                f"{identity.where} cannot serve {model_name(runner)}: layer {layer.layer_id} needs {reason}; "
                f"{variant_way_out(identity, layer.variant_features, peers)}"
            )
        if layer.layer_id in window_ids and layer.sliding_window_size < 0:
            raise identity.refuse(
                f"layer {layer.layer_id} of {model_name(runner)} without a window although SGLang keeps its "
                "keys in the hybrid pool's window part",
                "run SGLang with --disable-hybrid-swa-memory",
            )
    warning = dropped_window(runner, [layer.sliding_window_size for _, layer in walked])
    if warning is not None and warn_once_per_runner(runner):
        logger.warning("%s", warning)
    return walked
