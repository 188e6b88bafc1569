"""vLLM's full CUDA graphs over attnhost backends that declare graph support, driven as vLLM's GPU runner drives them.

The layer kit's graph cases (:mod:`attnhost_vllm_cpu.graphs`): ``get_cudagraph_support`` says ``UNIFORM_BATCH``,
``build_for_cudagraph_capture`` plans a uniform batch of four requests, and four replays pad 3, 1, 4 and 2 live
requests vLLM's way; each replay's metadata is the captured batch object re-planned in place, the live rows equal
float64 attention, their K/V lands at their slots and no other slot changes. Eagerly with vLLM's device tensors
refusing host reads, and through ``torch.compile(fullgraph=True)`` with every tensor the step reads at its capture
address; decode (one token) and speculative verify (three) batches, block sizes 1 and 16.
"""

from __future__ import annotations

import pytest
from attnhost_vllm_cpu.graphs import check_graph
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-no-host-reads", "compiled"])
@pytest.mark.parametrize("query_len", [1, 3], ids=["decode", "verify"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_uniform_batches_capture_and_replay_padded(block_size: int, query_len: int, compiled: bool) -> None:
    cls = AttentionBackendEnum.BATCHED_MATMUL.get_class()
    check_graph(cls, "batched_matmul", block_size=block_size, query_len=query_len, compiled=compiled)


def test_a_backend_without_graph_support_stays_out_of_vllms_graphs() -> None:
    cls = AttentionBackendEnum.TORCH_NATIVE.get_class()
    assert cls.get_builder_cls().get_cudagraph_support(None, None) is AttentionCGSupport.NEVER
    with pytest.raises(AssertionError, match="reports NEVER"):
        check_graph(cls, "torch_native", block_size=16)
