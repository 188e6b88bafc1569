"""TEST-ONLY out-of-tree SGLang platform: a real engine on a CPU-only machine, torch code paths, speculative allowed.

SGLang 0.5.23's own CPU routes need sgl-kernel's CPU build, which is not on
PyPI: with no platform selected, RoPE imports ``vllm._custom_ops``; with
``SGLANG_USE_CPU_ENGINE=1``, the KV pool imports ``sgl_kernel``. This platform
is registered through SGLang's own ``sglang.srt.platforms`` entry-point group
(this distribution's ``attnhost_test_cpu``) and reports a CPU device with
SGLang's default, conservative ``PlatformCapabilities()`` (no triton, no graph
capture), so RoPE and the fused ops take their torch paths and CUDA graphs
switch off by themselves.

For speculative decoding an out-of-tree platform must also answer what SGLang
asks it and nobody else: whether it allows the algorithm and the draft
backend (SGLang's defaults say no), which KV pool to build (the in-tree MHA
pool warms a triton copy kernel up when speculative decoding needs KV moves;
here the moves are torch's), and how to find the verify window's cache
locations (without an answer SGLang silently gets ``None``). The rest of
SGLang's speculative path launches triton kernels, which run on a CPU only
under ``TRITON_INTERPRET=1``; the two tree kernels that refuse out-of-tree
platforms outright get torch stand-ins from this kit's general plugin
(:mod:`attnhost_sglang_cpu.plugin`).

It activates only when ``SGLANG_PLATFORM`` names it. It is not part of attnhost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.interface import PlatformCapabilities, PlatformEnum, SRTPlatform

from attnhost_sglang_cpu import PLATFORM_NAME, platform_selected

#: Kept for callers of the old module: the entry-point name, also ``SGLANG_PLATFORM``'s value.
NAME = PLATFORM_NAME

#: The speculative algorithms allowed here: the ones whose worker runs on torch plus interpreted triton (DFLASH
#: with the scaffolding of :mod:`attnhost_sglang_cpu.dflash_plugin`).
SPECULATIVE_ALGORITHMS = frozenset({"STANDALONE", "EAGLE", "EAGLE3", "DFLASH"})


class AttnhostTestCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """SGLang on the host CPU with torch-only code paths."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def is_pin_memory_available(self, device: object = None) -> bool:
        return False

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm.upper() in SPECULATIVE_ALGORITHMS

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        """Any name SGLang's draft choices hold (SGLang's own and the plugins' that attnhost added): whether the
        draft worker can build it is SGLang's and the bridge's business, which the tests are there to see."""
        from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

        return backend in DRAFT_ATTENTION_BACKEND_CHOICES

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        """SGLang's ``torch_native``, except for DFLASH, which checks its fallback against SGLang's draft choices
        (``torch_native`` is not one): there SGLang's ``triton``, which DFLASH runs here under the triton
        interpreter (with :mod:`attnhost_sglang_cpu.dflash_plugin`'s scaffolding)."""
        return "triton" if algorithm.upper() == "DFLASH" else "torch_native"

    def get_kv_pool_cls(self, *, kind: Any) -> type | None:
        if kind != "mha":
            return None
        from attnhost_sglang_cpu.kv_pool import TorchMoveMHATokenToKVPool

        return TorchMoveMHATokenToKVPool

    def get_speculative_cache_locs_fn(self) -> Callable[..., Any] | None:
        from attnhost_sglang_cpu.spec_kernels import assign_extend_cache_locs

        return assign_extend_cache_locs


class AttnhostTestCpuGraphPlatform(AttnhostTestCpuPlatform):
    """The same platform with SGLang's decode graphs on: its own ``CPUGraphRunner`` (``torch.compile`` of the
    model with ``--enable-torch-compile``, the eager forward without), as SGLang's in-tree CPU platform has it.
    Selected with ``ATTNHOST_TEST_CPU_GRAPHS=1`` beside ``SGLANG_PLATFORM``."""

    capabilities = PlatformCapabilities(graph_capture=True)

    def get_graph_runner_cls(self) -> type | None:
        """SGLang's ``CPUGraphRunner``, started with :mod:`.compile_ops`' stand-ins for the ``sgl_kernel``
        operators it registers fake kernels for."""
        from sglang.srt.model_executor.cpu_graph_runner import CPUGraphRunner

        from attnhost_sglang_cpu.compile_ops import sgl_kernel_stand_ins

        class TestCpuGraphRunner(CPUGraphRunner):
            def __init__(self, model_runner: Any) -> None:
                with sgl_kernel_stand_ins():
                    super().__init__(model_runner)

        return TestCpuGraphRunner


#: Beside ``SGLANG_PLATFORM``, selects :class:`AttnhostTestCpuGraphPlatform`.
GRAPHS_ENV = "ATTNHOST_TEST_CPU_GRAPHS"


def activate() -> str | None:
    """SGLang's platform activation hook: this platform's class path when selected, else ``None``."""
    if not platform_selected():
        return None
    import os

    chosen = AttnhostTestCpuGraphPlatform if os.environ.get(GRAPHS_ENV) == "1" else AttnhostTestCpuPlatform
    return f"{__name__}:{chosen.__qualname__}"
