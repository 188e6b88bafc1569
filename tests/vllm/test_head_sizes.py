"""What the adapter answers vLLM about head sizes: the declared ``BackendCapabilities.head_dims`` (empty: any),
and, for vLLM 0.34's question about a V head size unlike K's (MiMo-V2), no: the contract has one ``head_dim`` for
K and V, so vLLM takes its own backend for such a layer instead of handing it to attnhost's."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from attnhost.backend import BackendCapabilities
from attnhost.engines.vllm.adapter import dense_backend_class


def _adapter(head_dims: tuple[int, ...]) -> type:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    identity = AttentionBackendEnum["TORCH_NATIVE"].get_class().identity
    return dense_backend_class(dataclasses.replace(identity, capabilities=BackendCapabilities(head_dims=head_dims)))


def test_any_head_size_with_equal_k_and_v_and_none_with_a_wider_or_narrower_v() -> None:
    cls = _adapter(())
    assert cls.supports_head_size(80) and cls.supports_head_size_v(80, 80)
    assert not cls.supports_head_size_v(192, 128) and not cls.supports_head_size_v(64, 128)


def test_declared_head_dims_bound_both_questions() -> None:
    cls = _adapter((64, 128))
    assert cls.get_supported_head_sizes() == [64, 128]
    assert cls.supports_head_size_v(128, 128) and not cls.supports_head_size_v(96, 96)
