"""``cpu_paged``: the attnhost contract on a compiled C++ kernel (``csrc/``), which reads the cache in place.

Per batch, ``init_forward_metadata`` has the kernel *plan* the batch: check every request's table row, lengths
and tree-mask block against the table, and copy out every ``req_to_token`` entry the batch reads, refusing one
that is not a slot (naming its row, position and value). The plan owns those copies, so what the layers read
cannot change under them, and the per-layer checks are a few comparisons against it (q's shape against the
batch and the layer, the largest slot against each layer's buffers): no scan of the batch per layer.
Per layer, the Python side is one call. The kernel first writes the new tokens' K/V at ``out_cache_loc`` itself:
the contract's ``k_buffer``/``v_buffer`` are the cache by slot, so a plain copy there is exactly ``set_kv``'s write
(where the dtypes differ, ``set_kv`` writes them instead, converted). It then splits the work over requests x KV
heads (and a lone long request's context) on torch's intra-op threads, and returns a fresh output in ``q``'s layout
and dtype (``flat_heads``: SGLang's ``[T, heads * head_dim]`` in, the same out). Softmax and sums are float32
for every dtype.

An FP8 cache is read as docs/kv-cache.md specifies, each entry ``stored.to(float32) * scale`` with the layer's
``k_scale`` / ``v_scale``, and written through ``set_kv`` with them. With pages (``kv_pool.page_size > 1``) the
plan copies ``forward_batch.page_table`` instead, and the kernel reads each page's slots as one run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnhost import AttentionBackend, AttentionLayer, BackendCapabilities

try:
    import _attnhost_cpukernels as _kernel
except ImportError as exc:  # present but unloadable: built against another torch, most often
    raise ImportError(
        f"attnhost-cpukernels: its compiled kernel _attnhost_cpukernels does not load with torch "
        f"{torch.__version__} ({exc}); rebuild it against this torch: "
        "pip install --no-build-isolation --force-reinstall attnhost-cpukernels"
    ) from exc

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost import AttentionRunner, ForwardBatch

__all__ = ["CpuPagedAttnBackend", "kernel_info"]


def kernel_info() -> dict[str, str]:
    """The instruction set the kernel picked on this CPU and the torch it was built against."""
    return {"isa": str(_kernel.isa), "built_with_torch": str(_kernel.torch_version)}


class CpuPagedAttnBackend(AttentionBackend):
    """Paged attention over a token-slot KV cache in one compiled call per layer (example plugin)."""

    capabilities = BackendCapabilities(
        flat_heads=True,
        tree_mask=True,
        kv_cache_dtypes=("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"),
        page_sizes=None,  # any: with pages it reads page_table, with token slots req_to_token
    )

    def __init__(self, runner: AttentionRunner | None = None) -> None:
        super().__init__(runner)
        self._batch: ForwardBatch | None = None
        self._plan: _kernel.Plan | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """The kernel's plan of the batch: its metadata checked, and the slots it reads copied, once."""
        self._batch = None  # a refused batch leaves no plan behind
        page_size = forward_batch.kv_pool.page_size
        if page_size > 1:  # the pages, walked in runs of page_size slots
            table, rows = forward_batch.page_table, list(range(forward_batch.batch_size))
        else:
            table, rows = forward_batch.kv_pool.req_to_token, forward_batch.req_pool_indices.tolist()
        self._plan = _kernel.plan(
            table,
            rows,
            forward_batch.prefix_lens_cpu,
            forward_batch.extend_seq_lens_cpu,
            forward_batch.tree_mask,
            page_size,
        )
        self._batch = forward_batch

    def forward_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> Tensor:
        plan = self._plan
        if forward_batch is not self._batch or plan is None:
            raise RuntimeError(
                "cpu_paged: init_forward_metadata() was not called for this ForwardBatch; "
                "call it once per batch before the layers run"
            )
        pool = forward_batch.kv_pool
        layer_id = layer.layer_id
        keys, values = pool.k_buffer(layer_id), pool.v_buffer(layer_id)
        new_k = new_v = loc = None
        if save_kv_cache:
            if k.dim() != 3:  # accepted flat, as SGLang's own backends accept them
                k = k.view(-1, layer.num_kv_heads, layer.head_dim)
                v = v.view(-1, layer.num_kv_heads, layer.head_dim)
            if k.dtype == keys.dtype and v.dtype == values.dtype:  # the kernel writes them (a plain copy)
                new_k, new_v, loc = k, v, forward_batch.out_cache_loc
            else:  # a conversion (an FP8 cache quantises with the layer's scales): the cache's own write
                pool.set_kv(layer_id, forward_batch.out_cache_loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        out: Tensor = _kernel.attend(
            q,
            keys,
            values,
            plan,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.scaling,
            new_k,
            new_v,
            loc,
            layer.k_scale,
            layer.v_scale,
        )
        return out

    forward_decode = forward_extend
