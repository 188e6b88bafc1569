"""SGLang's own MLA attention kit, driven for one backend name (used by tests/sglang and the engine suite).

The kit (``sglang.test.kits.attention_unittest.attention_methods.mla_attention``)
builds a backend by name through SGLang's ``ATTENTION_BACKENDS`` for a model
runner with ``use_mla_backend`` on a real ``MLATokenToKVPool`` with shuffled
pages, writes each request's prefix latent rows itself, calls the absorbed
form (``k = v = None``, ``save_kv_cache=False``) through a real
``RadixAttention`` and compares against its own reference. It runs without a
rotary part by default; :data:`ROPE_DIMS` adds DeepSeek's (the latent row
then holds both, and the kit writes them with ``set_mla_kv_buffer``).
Importing this module imports SGLang (install the shim first).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
    build_mla_attention_fixture,
    make_mla_cases,
    run_mla_attention_case,
)

from attnhost_sglang_cpu.dense import KitCase, failure_named

__all__ = ["ROPE_DIMS", "build_mla_fixture", "mla_cases", "run_mla_case"]

#: ``qk_rope_head_dim`` of the kit's latent (``kv_lora_rank`` 32): the kit's own default (none) and a rotary part.
ROPE_DIMS = (0, 16)


def mla_cases(backend: str) -> list[Any]:
    """SGLang's MLA cases for *backend* (the same list for every name)."""
    return list(make_mla_cases(backend))


def run_mla_case(case: Any, dtype: torch.dtype, qk_rope_head_dim: int) -> None:
    """One case of SGLang's MLA kit, as the kit runs it; a numeric failure leads with the backend, case, dtype,
    latent shape and error size (torch's own message names none of them)."""
    dtype_name = str(dtype).removeprefix("torch.")
    lead = f"backend {case.backend!r}, SGLang MLA case {case.name!r} ({dtype_name}, rope {qk_rope_head_dim})"
    with torch.no_grad(), failure_named(lead):
        run_mla_attention_case(KitCase(), case, device="cpu", dtype=dtype, qk_rope_head_dim=qk_rope_head_dim)


def build_mla_fixture(case: Any, dtype: torch.dtype = torch.float32, qk_rope_head_dim: int = 16) -> Any:
    with torch.no_grad():
        return build_mla_attention_fixture(
            KitCase(), case, device="cpu", dtype=dtype, qk_rope_head_dim=qk_rope_head_dim
        )
