"""vLLM's x86 Triton rule, answered for the kit's configs only: a ``VllmConfig`` on this CPU without triton-cpu.

From vLLM 0.34, ``CpuPlatform.check_and_update_config`` (which every ``VllmConfig`` runs in ``__post_init__``) first
refuses an x86 CPU without Triton: ``RuntimeError: vLLM on x86 CPUs requires Triton (triton-cpu).`` (0.33 only
warned). The rule protects vLLM's x86 CPU *model runner*, whose kernels are Triton's; vLLM's ``triton-cpu`` is not on
PyPI, and this kit runs no model runner (the PyPI wheel's ``vllm._C`` is a CUDA build): it builds configs, metadata
builders, caches and attention layers, none of which reads Triton.

:func:`answer_x86_triton_rule` wraps ``CpuPlatform.check_and_update_config`` in this process only. The wrapper calls
vLLM's own method unchanged; only when that refuses with the rule's message (raised before the method changes
anything) does it call it once more with ``vllm.triton_utils.HAS_TRITON`` read as true for the length of that call,
so vLLM applies every one of its other CPU settings to the config. Everything else in the process still sees
``HAS_TRITON`` false (vLLM's worker keeps refusing to build a model runner without Triton), nothing is installed for
other processes (no ``vllm.platform_plugins`` or ``vllm.general_plugins`` entry point, no ``.pth``), and on a vLLM
that only warns (0.33) or a machine with triton-cpu the wrapper never steps in. Call it after
:func:`attnhost_vllm_cpu.use_cpu_environment`, before building a ``VllmConfig``; calling it again does nothing.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["RULE", "answer_x86_triton_rule"]

RULE = "requires Triton (triton-cpu)"
"""What vLLM's refusal says (``vLLM on x86 CPUs requires Triton (triton-cpu).``): the only error answered."""


def answer_x86_triton_rule() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` as the module docstring says (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "__attnhost_vllm_cpu__", False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        try:
            original(cls, vllm_config)
            return
        except RuntimeError as exc:
            if RULE not in str(exc):
                raise
        import vllm.triton_utils as triton_utils

        before = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True  # read by the rule's own `from vllm.triton_utils import HAS_TRITON`
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = before

    check_and_update_config.__attnhost_vllm_cpu__ = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
