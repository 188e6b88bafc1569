"""``cpu_paged``: the attnhost contract on a compiled C++ kernel (``csrc/``), which reads the cache in place.

Per batch, ``init_forward_metadata`` has the kernel *plan* the batch: check every request's table row, lengths
and tree-mask block against the table, and copy out every ``req_to_token`` entry the batch reads, refusing one
that is not a slot (naming its row, position and value). The plan owns those copies, so what the layers read
cannot change under them, and the per-layer checks are a few comparisons against it (q's shape against the
batch and the layer, the largest slot against each layer's buffers): no scan of the batch per layer.
Per layer, the Python side is one call. The kernel first writes the new tokens' K/V at ``out_cache_loc`` itself:
the contract's ``k_buffer``/``v_buffer`` are the cache by slot, so a plain copy there is exactly ``set_kv``'s write
(where the dtypes differ, of the new K/V converted first as ``set_kv`` converts them), and only after every check:
a refused call leaves the cache as it was. It then splits the work over requests x KV
heads (and a lone long request's context) on torch's intra-op threads, and returns a fresh output in ``q``'s layout
and dtype (``flat_heads``: SGLang's ``[T, heads * head_dim]`` in, the same out). Softmax and sums are float32
for every dtype.

An FP8 cache is read as docs/kv-cache.md specifies, each entry ``stored.to(float32) * scale`` with the layer's
``k_scale`` / ``v_scale``, and written quantised with them (:func:`attnhost.quantize_fp8`). With pages
(``kv_pool.page_size > 1``) the plan copies ``forward_batch.page_table`` instead, and the kernel reads each page's
slots as one run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnhost import FP8_DTYPES, AttentionBackend, AttentionLayer, BackendCapabilities, quantize_fp8

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


class _Plan:
    """One batch's plan, in tensors the kernel fills (``plan_into``) and reads (``attend``): allocated for the batch
    object's first plan, refilled in place when the same object is planned again (a graph step), so a captured
    step reads the same storage at every replay."""

    __slots__ = ("batch", "header", "mask", "meta", "slots")

    def __init__(self, batch: ForwardBatch) -> None:
        page_size = batch.kv_pool.page_size
        # the host lengths size the plan (bounds will do: a graph step's exact ones are on the device)
        longest = max(batch.seq_lens_cpu, default=0)
        width = max(1, -(-longest // page_size))
        cells = sum(n * n for n in batch.extend_seq_lens_cpu) if batch.tree_mask is not None else 0
        device = batch.kv_pool.device
        self.batch = batch
        self.slots = torch.empty((batch.batch_size, width), dtype=torch.int64, device=device)
        self.meta = torch.empty((batch.batch_size, _kernel.meta_fields), dtype=torch.int64, device=device)
        self.mask = torch.empty((max(cells, 1),), dtype=torch.uint8, device=device)
        self.header = torch.zeros((_kernel.header_fields,), dtype=torch.int64, device=device)

    def fill(self) -> None:
        """Check the batch and copy what it reads into the plan, in place (the kernel reads the rows and lengths
        from their tensors)."""
        batch = self.batch
        _ops.plan_into(
            batch.kv_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            list(batch.extend_seq_lens_cpu),
            batch.tree_mask,
            batch.kv_pool.page_size,
            self.slots,
            self.meta,
            self.mask,
            self.header,
        )


class CpuPagedAttnBackend(AttentionBackend):
    """Paged attention over a token-slot KV cache in one compiled call per layer (example plugin)."""

    # cuda_graph: the kernel is a torch custom operator (traced as one call by torch.compile) over a plan in tensors
    # refilled in place per batch, and nothing in init_forward_metadata or a forward reads a length on the host
    capabilities = BackendCapabilities(
        cuda_graph=True,
        flat_heads=True,
        tree_mask=True,
        kv_cache_dtypes=("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"),
        page_sizes=None,  # any: with pages it reads every page_size-th entry of req_to_token, a page's first slot
    )

    def __init__(self, runner: AttentionRunner | None = None) -> None:
        super().__init__(runner)
        self._plan: _Plan | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """The kernel's plan of the batch: its metadata checked, and the slots it reads copied, once."""
        plan = self._plan
        self._plan = None  # a refused batch leaves no plan behind
        if plan is None or plan.batch is not forward_batch:
            plan = _Plan(forward_batch)
        plan.fill()
        self._plan = plan

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
        if plan is None or forward_batch is not plan.batch:
            raise RuntimeError(
                "cpu_paged: init_forward_metadata() was not called for this ForwardBatch; "
                "call it once per batch before the layers run"
            )
        pool = forward_batch.kv_pool
        keys, values = pool.k_buffer(layer.layer_id), pool.v_buffer(layer.layer_id)
        new_k = new_v = loc = None
        if save_kv_cache:
            if k.dim() != 3:  # accepted flat, as SGLang's own backends accept them
                k = k.view(-1, layer.num_kv_heads, layer.head_dim)
                v = v.view(-1, layer.num_kv_heads, layer.head_dim)
            # the kernel writes them (a plain copy) after its checks; another dtype is converted first, as set_kv
            # would store it (an FP8 cache: quantised with the layer's scales), so a refusal writes nothing either
            new_k = _as_stored(k, keys.dtype, layer.k_scale)
            new_v = _as_stored(v, values.dtype, layer.v_scale)
            loc = forward_batch.out_cache_loc
        out: Tensor = _ops.attend(
            q,
            keys,
            values,
            plan.slots,
            plan.meta,
            plan.mask,
            plan.header,
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


_ops = torch.ops.attnhost_cpukernels


def _as_stored(x: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``x`` as a cache of ``dtype`` stores it (``KVPool.set_kv``'s conversion): itself when the dtypes agree."""
    if x.dtype == dtype:
        return x
    return quantize_fp8(x, scale, dtype) if dtype in FP8_DTYPES else x.to(dtype)


@torch.library.register_fake("attnhost_cpukernels::attend")
def _attend_shape(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, *args: object) -> Tensor:
    """What the kernel returns, for tracing: a fresh output in q's shape and dtype, contiguous."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.register_fake("attnhost_cpukernels::plan_into")
def _plan_into_shape(*args: object) -> None:
    """The plan is filled in place: nothing returned."""
