"""TEST-ONLY out-of-tree vLLM platform: vLLM's own CPU platform, except that it honours an attnhost backend choice.

``CpuPlatform.get_attn_backend_cls`` returns ``CPU_ATTN`` (or a CPU MLA
backend) whatever ``--attention-backend`` or the speculative config's
``attention_backend`` chose. Here a choice that names a backend attnhost
registered with vLLM returns that backend's class path, so the layer runs
attnhost's adapter; every other choice gets vLLM's own CPU answer.

It activates only when :data:`~attnhost_vllm_engine_cpu.PLATFORM_ENV` selects
it (vLLM then prefers it to its built-in CPU platform). Note that
``VLLM_TARGET_DEVICE=cpu`` makes vLLM skip out-of-tree platforms altogether.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform

from attnhost_vllm_engine_cpu import platform_selected

ADAPTER_MODULE = "attnhost.engines.vllm.backends"


def is_attnhost_member(selected: Any) -> bool:
    """Whether an ``AttentionBackendEnum`` member is one attnhost registered (its class path is attnhost's)."""
    return selected is not None and str(getattr(selected, "value", "")).startswith(ADAPTER_MODULE + ".")


_overridden = False


class AttnhostTestCpuPlatform(CpuPlatform):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's CPU platform; an attnhost attention backend, when chosen, is used instead of ``CPU_ATTN``."""

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """vLLM's CPU stand-ins for its triton kernels, once per process: the kit's driver builds several engines in
        one process (importing vLLM is most of an engine's start here), and vLLM's rebinding fails the second time
        over its own wrappers."""
        global _overridden
        if not _overridden:
            super().register_triton_kernel_overrides()
            _overridden = True

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, *args: Any, **kwargs: Any) -> str:
        if is_attnhost_member(selected_backend):
            return str(selected_backend.get_path())
        return str(super().get_attn_backend_cls(selected_backend, attn_selector_config, *args, **kwargs))


def activate() -> str | None:
    """vLLM's platform-plugin hook: this platform's class path when selected, else ``None``."""
    if not platform_selected():
        return None
    return f"{__name__}.{AttnhostTestCpuPlatform.__qualname__}"
