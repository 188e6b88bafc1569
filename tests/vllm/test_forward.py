"""The adapter on vLLM's own metadata and KV cache: what the engine kit's forward matrix does not cover.

The matrix itself (prefill, decode, mixed and prefix-cached batches, MHA/GQA/MQA,
block sizes 1/4/16, every declared dtype, every KV-cache layout, against a
float64 reference) is the shipped engine kit's ``test_forward``
(``attnhost_vllm_cpu.suite``), run for the project's backends by
``test_engine_kit.py`` through ``pytest --attnhost-engine vllm``. Here, with
the kit's own batch builders (``attnhost_vllm_cpu.kit``) and forward
(``attnhost_vllm_cpu.forward``): bfloat16 over blocks handed out in order,
head size 128 with large blocks, that the KV buffers are vLLM's memory, and
that every builder gets its own backend.
"""

from __future__ import annotations

import re

import pytest
import torch
from attnhost_vllm_cpu.forward import BATCHES, forward, problem
from attnhost_vllm_cpu.kit import Case, make_case
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum

BACKENDS = ["torch_native", "tiny", "batched_matmul", "cpu_paged"]


def check(name: str, case: Case, dtype: torch.dtype, atol: float) -> None:
    """The kit's forward and check for one backend; the kit's one-line message on failure."""
    before = [cache.clone() for cache in case.caches]
    cls = AttentionBackendEnum[name.upper()].get_class()
    found = problem(case, forward(cls, case, dtype, name), before, atol)
    assert found is None, f"{name}: {found}"


@pytest.mark.parametrize("name", BACKENDS)
def test_bfloat16_and_contiguous_blocks(name: str) -> None:
    """bfloat16 end to end, and blocks handed out in order (torch_native then reads views, not gathers)."""
    case = make_case(
        BATCHES["mixed"], block_size=16, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, shuffle_blocks=False
    )
    check(name, case, torch.bfloat16, atol=2e-2)


def test_head_size_128_large_blocks() -> None:
    case = make_case([(70, 1), (0, 40), (100, 3)], block_size=32, num_heads=4, num_kv_heads=2, head_size=128)
    check("torch_native", case, torch.float32, atol=2e-5)


def test_kv_views_are_vllms_memory() -> None:
    """The buffers the attnhost backend reads are views of vLLM's tensor: same storage, strided, no copy."""
    case = make_case(BATCHES["decode"], block_size=16, num_heads=4, num_kv_heads=2)
    cls = AttentionBackendEnum.TORCH_NATIVE.get_class()
    builder = cls.get_builder_cls()(case.spec, ["layer.0"], VllmConfig(), "cpu")
    metadata = builder.build(0, case.metadata)
    impl = cls.get_impl_cls()(4, 32, 32**-0.5, 2, None, None, "auto", None, AttentionType.DECODER, None)
    q, k, v = case.layer_inputs(0, torch.float32)
    impl.forward(None, q, k, v, case.caches[0], metadata, output=torch.empty(q.shape[0], 4, 32))
    kv = metadata.kv
    k_buf, v_buf = kv.k_buffer(impl.layer.layer_id), kv.v_buffer(impl.layer.layer_id)
    storage = case.caches[0].untyped_storage().data_ptr()
    assert k_buf.untyped_storage().data_ptr() == storage == v_buf.untyped_storage().data_ptr()
    assert k_buf.shape == (case.caches[0].shape[0] * 16, 2, 32) and not k_buf.is_contiguous()
    assert v_buf.data_ptr() - k_buf.data_ptr() == 32 * k_buf.element_size()  # V sits right after K in each slot
    # req_to_token is block_table at token level: the slot of token p is block * block_size + p % block_size
    r = case.requests[1]
    row = kv.req_to_token[1, : r.seq].tolist()
    assert row == [r.blocks[p // 16] * 16 + p % 16 for p in range(r.seq)]


def test_each_builder_gets_its_own_backend_stamped_with_its_name() -> None:
    """Target and draft groups (or two KV-cache groups) never share an attnhost backend (SGLang #28559)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cls = AttentionBackendEnum.TINY.get_class()
    target_spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    draft_spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, is_draft=True)
    target = cls.get_builder_cls()(target_spec, ["model.layers.0.attn"], VllmConfig(), "cpu")
    draft = cls.get_builder_cls()(draft_spec, ["draft.layers.0.attn"], VllmConfig(), "cpu")
    assert target.attnhost_backend is not draft.attnhost_backend
    assert type(target.attnhost_backend).__name__ == "TinyAttnBackend"
    for builder in (target, draft):
        backend = builder.attnhost_backend
        assert backend.prefill_attention_backend_str == backend.decode_attention_backend_str == "tiny"


@pytest.mark.parametrize("error", [ValueError("illegal instruction"), SystemExit(3)], ids=["exception", "SystemExit"])
def test_a_backend_that_raises_is_named_with_its_plugin_mode_and_layer(error: BaseException) -> None:
    """vLLM's own traceback would end in the plugin's bare exception: attnhost's sentence names who failed where."""
    from attnhost import BackendFailedError

    case = make_case(BATCHES["decode"], block_size=16, num_heads=4, num_kv_heads=2)
    cls = AttentionBackendEnum.TORCH_NATIVE.get_class()
    builder = cls.get_builder_cls()(case.spec, ["layer.0"], VllmConfig(), "cpu")

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    builder.attnhost_backend.forward_decode = fail  # the kernel of a plugin that breaks on this machine
    metadata = builder.build(0, case.metadata)
    impl = cls.get_impl_cls()(4, 32, 32**-0.5, 2, None, None, "auto", None, AttentionType.DECODER, None)
    q, k, v = case.layer_inputs(0, torch.float32)
    with pytest.raises(BackendFailedError) as caught:
        impl.forward(None, q, k, v, case.caches[0], metadata, output=torch.empty(q.shape[0], 4, 32))
    assert caught.value.__cause__ is error
    pattern = (
        r"^attnhost backend 'torch_native' \(plugin 'builtin' \(distribution attnhost [^)]+\)\), vLLM "
        rf"--attention-backend TORCH_NATIVE failed in forward \(DECODE batch, layer {impl.layer.layer_id}\): "
        rf"{type(error).__name__}.*report this to the maintainers of plugin 'builtin'"
    )
    assert re.search(pattern, str(caught.value)), str(caught.value)
