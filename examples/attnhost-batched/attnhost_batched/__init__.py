"""The plugin module: what ``attnhost list`` imports. Hooks only, no torch, no kernels.

The backend itself lives in :mod:`attnhost_batched.backend` and is named by a
``"module:attr"`` string, so discovery never imports it (nor torch): only a
model runner that picks ``batched_matmul`` pays for the import.
"""

from __future__ import annotations

from attnhost import BackendSpec, hookimpl

__all__ = ["BACKEND_NAME", "attnhost_attention_backends", "attnhost_draft_attention_backends"]

BACKEND_NAME = "batched_matmul"


@hookimpl
def attnhost_attention_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name=BACKEND_NAME,
            factory="attnhost_batched.backend:BatchedMatmulAttnBackend",
            requires=("torch",),
            description="the whole batch in one padded, masked matmul-softmax-matmul (example plugin)",
        )
    ]


@hookimpl
def attnhost_draft_attention_backends() -> list[str]:
    # Listing a name here lets speculative draft workers use it
    # (`--speculative-draft-attention-backend batched_matmul`).
    return [BACKEND_NAME]
