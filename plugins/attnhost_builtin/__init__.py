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
_SGL = ("sgl_kernel", "sgl-kernel")
_FLASHINFER = ("flashinfer", "flashinfer-python")

_DECLARED: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, str], str], ...] = (
    # name, aliases, platforms, (kernel module, the pip distribution providing it), description
    ("triton", (), ("cuda", "rocm", "xpu"), ("triton", "triton"), "Triton kernels (SGLang's portable GPU backend)"),
    ("flex_attention", (), ("cuda", "cpu"), ("torch", "torch"), "PyTorch FlexAttention"),
    ("dsa", ("nsa",), _GPU, _SGL, "DeepSeek sparse attention (formerly 'nsa')"),
    ("qsa", (), _CUDA, _SGL, "Sparse attention for Qwen-style models"),
    ("dsv4", ("compressed",), _CUDA, _SGL, "DeepSeek-V4 compressed attention (formerly 'compressed')"),
    ("fa3", (), _CUDA, _SGL, "FlashAttention-3 (Hopper)"),
    ("fa4", (), _CUDA, ("flash_attn", "flash-attn"), "FlashAttention-4 (CuTe DSL, Blackwell)"),
    ("flashinfer", (), _CUDA, _FLASHINFER, "FlashInfer kernels (SGLang's default on CUDA)"),
    (
        "llada2_cfg_flashinfer",
        (),
        _CUDA,
        _FLASHINFER,
        "FlashInfer with classifier-free guidance for LLaDA2 diffusion models",
    ),
    ("flashmla", (), _CUDA, _SGL, "FlashMLA for multi-head latent attention models"),
    ("trtllm_mla", (), _CUDA, _FLASHINFER, "TensorRT-LLM MLA kernels via FlashInfer (Blackwell)"),
    (
        "cutedsl_mla",
        ("tokenspeed_mla",),
        _CUDA,
        ("cutlass", "nvidia-cutlass-dsl"),
        "CuTe DSL MLA kernels (formerly 'tokenspeed_mla')",
    ),
    (
        "trtllm_mha",
        (),
        _CUDA,
        _FLASHINFER,
        "TensorRT-LLM MHA kernels via FlashInfer; as a draft backend only for decode-only dense-MQA draft models",
    ),
    ("hpc_ops", (), _CUDA, ("hpc_ops", "hpc-ops"), "HPC-Ops attention kernels"),
    ("minicpm_flashattn", (), _CUDA, _SGL, "FlashAttention for MiniCPM sparse attention"),
    ("minicpm_flashinfer", (), _CUDA, _FLASHINFER, "FlashInfer for MiniCPM sparse attention"),
    ("aiter", (), _ROCM, ("aiter", "aiter"), "AMD AITER kernels (ROCm)"),
    ("wave", (), _ROCM, ("wave_lang", "wave-lang"), "AMD Wave kernels (ROCm)"),
    ("intel_amx", (), ("cpu",), _SGL, "Intel AMX kernels for Xeon CPUs"),
    ("ascend", (), ("npu",), ("torch_npu", "torch-npu"), "Huawei Ascend NPU kernels"),
    ("intel_xpu", (), ("xpu",), _SGL, "Intel GPU (XPU) kernels"),
)

_TORCH_NATIVE = BackendSpec(
    name="torch_native",
    factory="attnhost_builtin.torch_native:TorchNativeAttnBackend",
    requires=("torch",),
    provided_by="torch",
    description="PyTorch scaled_dot_product_attention over the token-slot KV cache; runs anywhere",
)
_DECLARED_SPECS = tuple(
    BackendSpec(name=name, aliases=aliases, platforms=platforms, requires=(module,), provided_by=dist, description=text)
    for name, aliases, platforms, (module, dist), text in _DECLARED
)

SGLANG_BACKENDS: tuple[BackendSpec, ...] = (_DECLARED_SPECS[0], _TORCH_NATIVE, *_DECLARED_SPECS[1:])
"""SGLang 0.5.23's attention backends, in SGLang's order: ``torch_native`` implemented, the rest declared only."""

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
