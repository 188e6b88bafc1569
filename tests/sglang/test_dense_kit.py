"""SGLang's own dense-attention test kit, run against attnhost backends through the bridge (driven by the test
kit's ``attnhost_sglang_cpu.dense``, the same code ``pytest --attnhost-engine sglang`` runs).

The kit (``sglang.test.kits.attention_unittest``) builds each backend by
name through SGLang's ``ATTENTION_BACKENDS``, on real ``ReqToTokenPool`` /
``MHATokenToKVPool`` / ``RadixAttention`` objects with shuffled pages, and
compares against its own reference. The names resolve to attnhost's
adapter only because SGLang's own ``load_plugins()`` ran attnhost's entry
point: nothing here registers anything by hand.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.dense import DTYPES, build_fixture, dense_cases, run_case  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402

from attnhost.engines.sglang.adapter import SGLangAdapterBackend  # noqa: E402

BACKENDS = ("attnhost_torch_native", "tiny", "batched_matmul", "cpu_paged")


CASES = [
    pytest.param(backend, dtype, case, id=f"{backend}-{str(dtype).removeprefix('torch.')}-{case.name}")
    for backend in BACKENDS
    for dtype in DTYPES
    for case in dense_cases(backend)
]


@pytest.mark.parametrize(("backend", "dtype", "case"), CASES)
def test_dense_case(backend: str, dtype: torch.dtype, case: object) -> None:
    run_case(case, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_kit_builds_attnhosts_adapter_with_its_own_backend(backend: str) -> None:
    assert ATTENTION_BACKENDS[backend].__module__ == "attnhost.engines.sglang.bridge"
    case = dense_cases(backend)[0]
    first = build_fixture(case)
    second = build_fixture(case)
    assert isinstance(first.backend, SGLangAdapterBackend)
    assert first.backend.attnhost_backend is not second.backend.attnhost_backend  # one attnhost backend per runner
    # the KV cache the attnhost backend sees is SGLang's own buffers, not copies
    pool = first.runner.token_to_kv_pool
    assert first.backend.attnhost_backend is not None
    kv = first.backend._kv
    assert kv.k_buffer(0).data_ptr() == pool.get_key_buffer(0).data_ptr()
    assert kv.req_to_token.data_ptr() == first.runner.req_to_token_pool.req_to_token.data_ptr()


def test_sglangs_own_torch_native_is_kept() -> None:
    assert ATTENTION_BACKENDS["torch_native"].__module__ == "sglang.srt.layers.attention.attention_registry"
