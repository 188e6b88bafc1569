"""vLLM's own ``Attention`` layer running an attnhost backend, through vLLM's forward context and custom op.

The layer is built as a model builds it (``Attention(..., attn_backend=cls)``,
inside ``set_current_vllm_config``), its ``kv_cache`` bound as vLLM's runner
binds it, and called inside ``set_forward_context`` with the adapter's
metadata: vLLM reshapes q/k/v, allocates ``output`` and dispatches through
``torch.ops.vllm.unified_attention_with_output`` to the adapter's impl. (On
the CPU platform vLLM's selector would ignore ``--attention-backend`` and
pick ``CPU_ATTN``, so the class is passed in, as models with a fixed backend
do; on a GPU the selector returns this same class for the name.)
"""

from __future__ import annotations

import pytest
import torch
from attnhost_vllm_cpu.kit import make_case
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.registry import AttentionBackendEnum


@pytest.mark.parametrize("name", ["torch_native", "tiny", "batched_matmul", "cpu_paged"])
def test_vllm_attention_layers(name: str) -> None:
    cls = AttentionBackendEnum[name.upper()].get_class()
    heads, kv_heads, dim = 8, 2, 32
    case = make_case([(9, 1), (0, 6), (21, 1), (13, 5)], block_size=16, num_heads=heads, num_kv_heads=kv_heads)
    config = VllmConfig()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(case.caches))]
    with set_current_vllm_config(config):
        layers = [Attention(heads, dim, dim**-0.5, num_kv_heads=kv_heads, prefix=n, attn_backend=cls) for n in names]
    for layer, cache in zip(layers, case.caches, strict=True):
        assert type(layer.impl).__qualname__ == f"{name.upper()}.Impl"
        assert layer.backend is AttentionBackendEnum[name.upper()]
        layer.kv_cache = cache
    builder = cls.get_builder_cls()(case.spec, names, config, "cpu")
    metadata = builder.build(0, case.metadata)
    n = case.num_tokens
    with set_forward_context(
        dict.fromkeys(names, metadata), config, slot_mapping=dict.fromkeys(names, case.metadata.slot_mapping)
    ):
        for i, layer in enumerate(layers):
            q, k, v = case.layer_inputs(i, torch.float32)
            out = layer(q.flatten(1), k.flatten(1), v.flatten(1))
            assert out.shape == (q.shape[0], heads * dim)
            torch.testing.assert_close(out[:n].view(n, heads, dim).double(), case.reference(i), atol=2e-5, rtol=2e-5)
            for r in case.requests:
                key, _ = case.cached(i, r, r.seq - 1)
                torch.testing.assert_close(key.double(), r.k[i][r.seq - 1], atol=0, rtol=0)
