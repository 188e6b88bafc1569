"""An out-of-tree SGLang platform for running a real engine on a CPU-only machine (test scaffolding).

SGLang 0.5.23's own CPU routes need sgl-kernel's CPU build, which is not on
PyPI: with no platform selected, RoPE imports ``vllm._custom_ops``; with
``SGLANG_USE_CPU_ENGINE=1``, the KV pool imports ``sgl_kernel``. This platform
is registered through SGLang's own ``sglang.srt.platforms`` entry-point group
(tests/sglang installs it as the distribution ``attnhost-test-cpu-platform``)
and reports a CPU device with SGLang's default, conservative
``PlatformCapabilities()`` (no triton, no graph capture), so RoPE and the fused
ops take their torch paths and CUDA graphs switch off by themselves.

It activates only when ``SGLANG_PLATFORM`` names it, so installing it changes
nothing else. It is not part of attnhost.
"""

from __future__ import annotations

import os

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.interface import PlatformCapabilities, PlatformEnum, SRTPlatform

#: The entry-point name, which is also the value ``SGLANG_PLATFORM`` must have.
NAME = "attnhost_test_cpu"


class AttnhostTestCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """SGLang on the host CPU with torch-only code paths."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def is_pin_memory_available(self, device: object = None) -> bool:
        return False


def activate() -> str | None:
    """SGLang's platform activation hook: this platform's class path when selected, else ``None``."""
    if os.environ.get("SGLANG_PLATFORM") != NAME:
        return None
    return f"{__name__}:{AttnhostTestCpuPlatform.__qualname__}"
