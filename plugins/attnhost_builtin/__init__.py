"""attnhost's built-in plugin: SGLang 0.5.23's attention backend names, and ``torch_native``.

It is registered through the same entry-point group as any third-party
plugin (see attnhost's ``pyproject.toml``), so the core knows no backend by
name. Every SGLang name is declared with the platforms it runs on, the
module its kernels come from and the pip distribution providing them; only
``torch_native`` is implemented here, since it is the one that runs on any
machine. The rest are declared-only until a plugin implements them — listed
honestly as such, never stubbed.

This module must stay cheap to import: it is loaded by ``attnhost list``.
"""

from __future__ import annotations

from attnhost import BackendSpec, hookimpl

__all__ = ["DRAFT_CAPABLE", "SGLANG_BACKENDS"]

_CUDA = ("cuda",)
_ROCM = ("rocm",)
_GPU = ("cuda", "rocm")

SGLANG_BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(
        name="triton",
        platforms=("cuda", "rocm", "xpu"),
        requires=("triton",),
        provided_by="triton",
        description="Triton kernels (SGLang's portable GPU backend)",
    ),
    BackendSpec(
        name="torch_native",
        factory="attnhost_builtin.torch_native:TorchNativeAttnBackend",
        requires=("torch",),
        provided_by="torch",
        description="PyTorch scaled_dot_product_attention over the token-slot KV cache; runs anywhere",
    ),
    BackendSpec(
        name="flex_attention",
        platforms=("cuda", "cpu"),
        requires=("torch",),
        provided_by="torch",
        description="PyTorch FlexAttention",
    ),
    BackendSpec(
        name="dsa",
        aliases=("nsa",),
        platforms=_GPU,
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="DeepSeek sparse attention (formerly 'nsa')",
    ),
    BackendSpec(
        name="qsa",
        platforms=_CUDA,
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="Sparse attention for Qwen-style models",
    ),
    BackendSpec(
        name="dsv4",
        aliases=("compressed",),
        platforms=_CUDA,
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="DeepSeek-V4 compressed attention (formerly 'compressed')",
    ),
    BackendSpec(
        name="fa3",
        platforms=_CUDA,
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="FlashAttention-3 (Hopper)",
    ),
    BackendSpec(
        name="fa4",
        platforms=_CUDA,
        requires=("flash_attn",),
        provided_by="flash-attn",
        description="FlashAttention-4 (CuTe DSL, Blackwell)",
    ),
    BackendSpec(
        name="flashinfer",
        platforms=_CUDA,
        requires=("flashinfer",),
        provided_by="flashinfer-python",
        description="FlashInfer kernels (SGLang's default on CUDA)",
    ),
    BackendSpec(
        name="llada2_cfg_flashinfer",
        platforms=_CUDA,
        requires=("flashinfer",),
        provided_by="flashinfer-python",
        description="FlashInfer with classifier-free guidance for LLaDA2 diffusion models",
    ),
    BackendSpec(
        name="flashmla",
        platforms=_CUDA,
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="FlashMLA for multi-head latent attention models",
    ),
    BackendSpec(
        name="trtllm_mla",
        platforms=_CUDA,
        requires=("flashinfer",),
        provided_by="flashinfer-python",
        description="TensorRT-LLM MLA kernels via FlashInfer (Blackwell)",
    ),
    BackendSpec(
        name="cutedsl_mla",
        aliases=("tokenspeed_mla",),
        platforms=_CUDA,
        requires=("cutlass",),
        provided_by="nvidia-cutlass-dsl",
        description="CuTe DSL MLA kernels (formerly 'tokenspeed_mla')",
    ),
    BackendSpec(
        name="trtllm_mha",
        platforms=_CUDA,
        requires=("flashinfer",),
        provided_by="flashinfer-python",
        description="TensorRT-LLM MHA kernels via FlashInfer; as a draft backend only for "
        "decode-only dense-MQA draft models",
    ),
    BackendSpec(
        name="hpc_ops",
        platforms=_CUDA,
        requires=("hpc_ops",),
        provided_by="hpc-ops",
        description="HPC-Ops attention kernels",
    ),
    BackendSpec(
        name="minicpm_flashattn",
        platforms=_CUDA,
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="FlashAttention for MiniCPM sparse attention",
    ),
    BackendSpec(
        name="minicpm_flashinfer",
        platforms=_CUDA,
        requires=("flashinfer",),
        provided_by="flashinfer-python",
        description="FlashInfer for MiniCPM sparse attention",
    ),
    BackendSpec(
        name="aiter",
        platforms=_ROCM,
        requires=("aiter",),
        provided_by="aiter",
        description="AMD AITER kernels (ROCm)",
    ),
    BackendSpec(
        name="wave",
        platforms=_ROCM,
        requires=("wave_lang",),
        provided_by="wave-lang",
        description="AMD Wave kernels (ROCm)",
    ),
    BackendSpec(
        name="intel_amx",
        platforms=("cpu",),
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="Intel AMX kernels for Xeon CPUs",
    ),
    BackendSpec(
        name="ascend",
        platforms=("npu",),
        requires=("torch_npu",),
        provided_by="torch-npu",
        description="Huawei Ascend NPU kernels",
    ),
    BackendSpec(
        name="intel_xpu",
        platforms=("xpu",),
        requires=("sgl_kernel",),
        provided_by="sgl-kernel",
        description="Intel GPU (XPU) kernels",
    ),
)

DRAFT_CAPABLE: tuple[str, ...] = ("flashinfer", "fa3", "fa4", "triton", "ascend", "trtllm_mha", "intel_xpu")
"""SGLang's ``DRAFT_ATTENTION_BACKEND_CHOICES``; ``trtllm_mha`` only for decode-only dense-MQA drafts."""

_DEFAULT_TARGET = {
    "cuda": "flashinfer",
    "rocm": "aiter",
    "xpu": "intel_xpu",
    "npu": "ascend",
    "cpu": "torch_native",
    "mps": "torch_native",
}


@hookimpl
def attnhost_attention_backends() -> list[BackendSpec]:
    return list(SGLANG_BACKENDS)


@hookimpl
def attnhost_draft_attention_backends() -> list[str]:
    return list(DRAFT_CAPABLE)


@hookimpl(trylast=True)
def attnhost_draft_fallback(platform: str) -> str:
    """SGLang's rule: ``triton`` on ROCm (HIP builds of torch), ``flashinfer`` everywhere else."""
    return "triton" if platform == "rocm" else "flashinfer"


@hookimpl(trylast=True)
def attnhost_default_attention_backend(platform: str) -> str | None:
    return _DEFAULT_TARGET.get(platform)
