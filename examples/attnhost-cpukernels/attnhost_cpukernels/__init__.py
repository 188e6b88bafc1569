"""The plugin module: what ``attnhost list`` imports. Hooks only: no torch, no compiled code.

The compiled kernel is its own top-level extension module, ``_attnhost_cpukernels``, named in the spec's
``requires``: attnhost decides availability by looking the module up (``importlib.util.find_spec``), which finds
the built ``.so`` without loading it. Where it was never built (a source checkout on ``sys.path``) or was built
for another platform or Python (its file name carries the ABI tag, so it is not found), the backend is listed as
unavailable with one line that says to reinstall, and nothing here ever imports torch.
"""

from __future__ import annotations

from attnhost import BackendSpec, hookimpl

__all__ = ["BACKEND_NAME", "KERNEL_MODULE", "attnhost_attention_backends", "attnhost_draft_attention_backends"]

BACKEND_NAME = "cpu_paged"
KERNEL_MODULE = "_attnhost_cpukernels"


@hookimpl
def attnhost_attention_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name=BACKEND_NAME,
            factory="attnhost_cpukernels.backend:CpuPagedAttnBackend",
            platforms=("cpu",),
            requires=("torch", KERNEL_MODULE),
            description="compiled C++ paged attention reading the KV cache in place (example plugin)",
        )
    ]


@hookimpl
def attnhost_draft_attention_backends() -> list[str]:
    return [BACKEND_NAME]
