"""TEST-ONLY general SGLang plugin: on the test platform, torch stand-ins for SGLang's two tree kernels.

Registered in SGLang's ``sglang.srt.plugins`` group (entry point
``attnhost_test_cpu_kernels``). SGLang runs it in every process through its own
``load_plugins()``; SGLang itself already skips it when ``SGLANG_PLATFORM``
names another platform, and :func:`register` returns at once unless
``SGLANG_PLATFORM=attnhost_test_cpu``. Then it REPLACEs, through SGLang's own
``HookRegistry`` (which also rebinds the modules that imported them by name,
such as ``sglang.srt.speculative.eagle_utils``),
``build_tree_kernel_efficient_func`` and ``verify_tree_greedy_func`` of
``sglang.kernels.ops.speculative.spec_tree``, which reject every out-of-tree
platform, with the faithful torch ports in :mod:`attnhost_sglang_cpu.spec_kernels`.
"""

from __future__ import annotations

from typing import Any

from attnhost_sglang_cpu import platform_selected

SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"
#: SGLang function -> its stand-in in attnhost_sglang_cpu.spec_kernels.
REPLACED = {
    "build_tree_kernel_efficient_func": "build_tree_kernel_efficient",
    "verify_tree_greedy_func": "verify_tree_greedy",
}


def register() -> None:
    """SGLang general-plugin entry point: install the stand-ins when (and only when) the test platform is selected."""
    if not platform_selected():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, name in REPLACED.items():
        HookRegistry.register(f"{SPEC_TREE}.{target}", _lazy(name), HookType.REPLACE)


def _lazy(name: str) -> Any:
    """The stand-in, imported on first call (torch is not imported while plugins load)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        from attnhost_sglang_cpu import spec_kernels

        return getattr(spec_kernels, name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"attnhost_test_cpu_{name}"
    return call
