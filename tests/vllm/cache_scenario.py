"""One vLLM process with a plugin that declares pages of 32 and float caches only: what vLLM's selector, the
builder and the impl say about block size 16 and FP8 caches. Prints one ``RESULT: {...}`` line.

Run by ``test_cache_formats.py`` with the plugin's distribution first on ``PYTHONPATH``; vLLM loads its general
plugins once per process, so the plugin gets a process of its own.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

PLUGIN = {
    "paged32_attn": """
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [BackendSpec(name="paged32", factory="paged32_attn.backend:Paged32", requires=("torch",),
                        description="reads pages of 32 tokens in float caches")]
""",
    "paged32_attn.backend": """
from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class Paged32(TorchNativeAttnBackend):
    capabilities = BackendCapabilities(
        dtypes=("float32", "bfloat16", "float16"),
        kv_cache_dtypes=("float32", "bfloat16", "float16"),
        page_sizes=(32,),
    )
""",
}


def _error(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except Exception as exc:  # the message is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return ""


def main() -> None:
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from attnhost_vllm_cpu.triton_rule import answer_x86_triton_rule

    answer_x86_triton_rule()  # vLLM >= 0.34 refuses an x86 VllmConfig without triton-cpu (not on PyPI)
    import torch
    from selector import selector_reasons
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    cls = AttentionBackendEnum["PAGED32"].get_class()

    def reasons(**overrides: object) -> list[str]:
        return selector_reasons(cls, **{"block_size": 32, **overrides})

    def builder(block_size: int, kv_cache_dtype: str = "auto") -> object:
        fp8 = kv_cache_dtype != "auto"
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=2,
            head_size=32,
            dtype=torch.uint8 if fp8 else torch.float32,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
        )
        config = VllmConfig(cache_config=CacheConfig(cache_dtype=kv_cache_dtype))
        return cls.get_builder_cls()(spec, ["model.layers.0.self_attn.attn"], config, "cpu")

    def impl(kv_cache_dtype: str) -> object:
        return cls.get_impl_cls()(4, 32, 0.1, 2, None, None, kv_cache_dtype, None, AttentionType.DECODER, None)

    torch_native = AttentionBackendEnum["TORCH_NATIVE"].get_class()
    result = {
        "block_sizes": [str(size) for size in cls.get_supported_kernel_block_sizes()],
        "kv_dtypes": cls.supported_kv_cache_dtypes,
        "torch_native_kv_dtypes": torch_native.supported_kv_cache_dtypes,
        "torch_native_block_sizes": [str(size) for size in torch_native.get_supported_kernel_block_sizes()],
        "ok": reasons() + reasons(block_size=64),
        "block_16": reasons(block_size=16),
        "fp8": reasons(kv_cache_dtype="fp8"),
        "builder_32": _error(lambda: builder(32)),
        "builder_16": _error(lambda: builder(16)),
        "builder_fp8_e5m2": _error(lambda: builder(32, "fp8_e5m2")),
        "impl_fp8": _error(lambda: impl("fp8")),
        "impl_auto": _error(lambda: impl("auto")),
    }
    print("RESULT: " + json.dumps(result))


if __name__ == "__main__":
    main()
