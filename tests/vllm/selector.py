"""What vLLM's attention selector says of one backend class for one configuration.

vLLM asks ``validate_configuration`` with a dozen keyword arguments; the tests vary one or two of them, so the
rest take the values of a plain bfloat16 decoder layer on a recent GPU, the case every backend here serves.
"""

from __future__ import annotations

from typing import Any


def selector_reasons(cls: Any, **overrides: object) -> list[str]:
    """``cls.validate_configuration`` for a plain decoder layer (head size 64, bfloat16, float cache in blocks of
    16, no MLA, sinks, sparsity or per-head scales, device capability 9.0), ``overrides`` replacing any of it; the
    reasons vLLM's selector would give for refusing it, empty when it would not."""
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    config: dict[str, object] = dict(
        head_size=64,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0),
        attn_type=AttentionType.DECODER,
    )
    config.update(overrides)
    found: list[str] = cls.validate_configuration(**config)
    return found
