"""What an SGLang model asks of its attention, read from the loaded model when a runner builds its adapter.

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

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention

__all__ = ["attention_layers", "dropped_window", "model_name", "warn_once_per_runner"]

_warned: weakref.WeakSet[Any] = weakref.WeakSet()


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
