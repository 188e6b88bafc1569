"""The adapter's forward equals a float64 reference on vLLM's own metadata and KV cache, for every shape of batch.

Each case: vLLM's KV cache (``allocate_kv_cache``, LBNHC) with the cached
prefixes written through its logical view, vLLM's ``CommonAttentionMetadata``
(int32 block table over shuffled blocks, int64 slot mapping, padded token
rows), the metadata built by the adapter's own builder, and two layers run
through the adapter's impl into vLLM's ``output`` tensor. Checked: the output
against float64 attention over each request's whole sequence, and the new
tokens' K/V read back from vLLM's cache where ``slot_mapping`` put them.
"""

from __future__ import annotations

import pytest
import torch
from kit import Case, make_case
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum

BACKENDS = ["torch_native", "tiny", "batched_matmul", "cpu_paged"]
BATCHES = {
    "prefill": [(0, 7), (0, 1), (0, 12)],
    "decode": [(5, 1), (17, 1), (1, 1), (40, 1)],
    "mixed": [(9, 1), (0, 6), (21, 1), (13, 5)],
    "prefix_cached": [(16, 4), (8, 9), (33, 2)],
}
SHAPES = [(4, 4), (8, 2), (4, 1)]  # (heads, kv_heads): MHA, GQA, MQA
BLOCK_SIZES = [1, 4, 16]


def run(name: str, case: Case, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Build the metadata with the adapter's builder, run every layer through its impl, return vLLM's outputs."""
    cls = AttentionBackendEnum[name.upper()].get_class()
    spec = case.spec
    builder = cls.get_builder_cls()(spec, [f"layer.{i}" for i in range(len(case.caches))], VllmConfig(), "cpu")
    metadata = builder.build(0, case.metadata)
    outputs = []
    for layer, cache in enumerate(case.caches):
        impl = cls.get_impl_cls()(
            case.num_heads, spec.head_size, spec.head_size**-0.5, spec.num_kv_heads,
            None, None, "auto", None, AttentionType.DECODER, None,
        )  # fmt: skip
        q, k, v = case.layer_inputs(layer, dtype)
        output = torch.full((q.shape[0], case.num_heads, spec.head_size), float("nan"), dtype=dtype)
        returned = impl.forward(None, q, k, v, cache, metadata, output=output)
        assert returned is output
        outputs.append(output)
    return outputs


def check(case: Case, outputs: list[torch.Tensor], atol: float) -> None:
    n = case.num_tokens
    for layer, output in enumerate(outputs):
        torch.testing.assert_close(output[:n].double(), case.reference(layer), atol=atol, rtol=atol)
        for r in case.requests:
            for p in range(r.prefix, r.seq):
                k, v = case.cached(layer, r, p)
                torch.testing.assert_close(k.double(), r.k[layer][p], atol=0, rtol=0)
                torch.testing.assert_close(v.double(), r.v[layer][p], atol=0, rtol=0)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", BACKENDS)
def test_forward_matches_float64_reference(name: str, batch: str, heads: int, kv_heads: int, block_size: int) -> None:
    case = make_case(BATCHES[batch], block_size=block_size, num_heads=heads, num_kv_heads=kv_heads)
    check(case, run(name, case), atol=2e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_bfloat16_and_contiguous_blocks(name: str) -> None:
    """bfloat16 end to end, and blocks handed out in order (torch_native then reads views, not gathers)."""
    case = make_case(
        BATCHES["mixed"], block_size=16, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, shuffle_blocks=False
    )
    check(case, run(name, case, torch.bfloat16), atol=2e-2)


def test_head_size_128_large_blocks() -> None:
    case = make_case([(70, 1), (0, 40), (100, 3)], block_size=32, num_heads=4, num_kv_heads=2, head_size=128)
    check(case, run("torch_native", case), atol=2e-5)


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
