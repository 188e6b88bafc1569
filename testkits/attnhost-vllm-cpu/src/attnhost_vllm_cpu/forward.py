"""One vLLM forward through a backend class on a :mod:`.kit` batch, and the check of what it computed and wrote.

The forward is vLLM's own sequence for a step: the backend's metadata
builder on vLLM's ``CommonAttentionMetadata`` (once per batch), then per
layer the impl's ``forward`` into vLLM's preallocated ``output``, with the
layer's KV cache from ``allocate_kv_cache``. The check compares the output
with float64 attention over each request's whole sequence, reads every new
token's K/V back through vLLM's logical cache view, and requires every other
cache entry unchanged (padded rows carry slot ``-1``: a write there lands in
the cache's last slot). A failure is one line naming the backend, the case
and the size of the error, as attnhost's conformance kit words it.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.attention.backend import AttentionType

from attnhost.backend import dtype_name
from attnhost.testing.host_reads import device_only, no_host_reads
from attnhost_vllm_cpu.kit import FP8_FORMATS, PLAIN, Case, Variant, make_case

__all__ = [
    "ATOL",
    "BATCHES",
    "BLOCK_SIZES",
    "CACHE_BATCHES",
    "CACHE_BLOCK_SIZES",
    "DTYPES",
    "FP8_CACHES",
    "SHAPES",
    "VARIANTS",
    "VARIANT_BLOCK_SIZES",
    "ForwardCase",
    "check",
    "dtype_name",
    "forward",
    "problem",
]

BATCHES: dict[str, list[tuple[int, int]]] = {
    "prefill": [(0, 7), (0, 1), (0, 12)],
    "decode": [(5, 1), (17, 1), (1, 1), (40, 1)],
    "mixed": [(9, 1), (0, 6), (21, 1), (13, 5)],
    "prefix_cached": [(16, 4), (8, 9), (33, 2)],
    "drafter_rejected": [(9, 4), (0, 6), (21, 3), (5, 1)],
}
"""``(cached prefix, new tokens)`` per request, for each kind of batch vLLM's scheduler forms."""
REJECTED: dict[str, list[int]] = {"drafter_rejected": [2, 0, 1, 0]}
"""Per request, how many of its last new tokens carry slot ``-1`` (vLLM's drafter marks rejected tokens so, between
other requests' real tokens): never written, never read, their outputs discarded."""
SHAPES: dict[str, tuple[int, int]] = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
"""(query heads, KV heads)."""
BLOCK_SIZES = (1, 4, 16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WINDOW = 8
"""vLLM's window (keys a query sees, itself included) in the windowed cases: shorter than most prefixes."""
VARIANTS: dict[str, tuple[list[tuple[int, int]], Variant]] = {
    # decode at the window's edge: sequences of W - 1, W, W + 1 keys and one far longer (W + 1 and W - 1 keys
    # instead of W both fail here)
    "window-decode-edge": ([(WINDOW - 2, 1), (WINDOW - 1, 1), (WINDOW, 1), (40, 1)], Variant(sliding_window=WINDOW)),
    # extend over a prefix the window crosses, a prefill longer than the window, a prefix shorter than it
    "window-extend": ([(16, 4), (5, 9), (33, 2), (0, 12)], Variant(sliding_window=WINDOW)),
    "window-longer-than-sequences": ([(16, 4), (8, 9), (33, 2)], Variant(sliding_window=64)),
    "softcap": ([(9, 1), (0, 6), (21, 1), (13, 5)], Variant(logits_soft_cap=1.5)),
    "sinks": ([(9, 1), (0, 6), (21, 1), (13, 5)], Variant(sinks=True)),
    "window-softcap-sinks": (
        [(16, 4), (WINDOW, 1), (33, 2), (0, 10)],
        Variant(sliding_window=WINDOW, logits_soft_cap=1.5, sinks=True),
    ),
    # vLLM's non-causal batch (a DFlash draft's block over its context): every key of the request, both ways
    "non-causal": ([(16, 4), (8, 9), (0, 6)], Variant(causal=False)),
    "non-causal-softcap-sinks": ([(16, 4), (0, 6)], Variant(logits_soft_cap=1.5, sinks=True, causal=False)),
}
"""``(cached prefix, new tokens)`` per request and the layers' variant, for each variant case (8 heads / 2 KV
heads; the windows in vLLM's terms, ``W`` keys)."""
VARIANT_BLOCK_SIZES = (1, 16)
"""Block size 1 nulls every token before a window; 16 keeps whole blocks of keys outside it readable."""
FP8_CACHES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's ``--kv-cache-dtype`` names of FP8 caches (``fp8`` and ``fp8_e4m3`` are both e4m3: each name must reach
the backend as that format)."""
CACHE_BATCHES = ("mixed", "prefix_cached", "decode", "drafter_rejected")
"""The batches of the FP8 cases: a prefix read back from the FP8 cache, new rows written into it, ``-1`` slots."""
CACHE_BLOCK_SIZES = (16, 32)
"""vLLM's default block size, and one whose pages hold more than most of the batches' prefixes."""
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Tolerance against the float64 reference (absolute, and as much again relative to the reference)."""


@dataclass(frozen=True)
class ForwardCase:
    """One cell of the suite's matrix, named as its failure message names it."""

    batch: str
    shape: str
    block_size: int
    dtype: torch.dtype
    layout: str = "LBNHC"
    variant: str | None = None
    """A key of :data:`VARIANTS` (its requests replace ``batch``'s), or ``None`` for plain causal attention."""
    kv_cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype``: ``auto`` (the model's dtype) or one of :data:`FP8_CACHES`."""

    @property
    def cache_dtype_name(self) -> str:
        """The dtype the cache stores, as capabilities name it (``float8_e4m3fn`` for ``fp8``)."""
        return dtype_name(FP8_FORMATS.get(self.kv_cache_dtype, self.dtype))

    @property
    def requests(self) -> list[tuple[int, int]]:
        return BATCHES[self.batch] if self.variant is None else VARIANTS[self.variant][0]

    @property
    def attention(self) -> Variant:
        return PLAIN if self.variant is None else VARIANTS[self.variant][1]

    def describe(self) -> str:
        heads, kv_heads = SHAPES[self.shape]
        what = f"{self.batch} batch" if self.variant is None else f"{self.variant} ({self.attention.describe()}) batch"
        return (
            f"{what} {self.requests}, {heads} heads / {kv_heads} KV heads, block size "
            f"{self.block_size}, {dtype_name(self.dtype)}, {self.layout} KV cache{self._cache_format()}"
        )

    def _cache_format(self) -> str:
        if self.kv_cache_dtype == "auto":
            return ""
        return f" of {self.cache_dtype_name} (--kv-cache-dtype {self.kv_cache_dtype})"

    def make(self) -> Case:
        from vllm.v1.kv_cache_interface import KVCacheLayout

        heads, kv_heads = SHAPES[self.shape]
        return make_case(
            self.requests,
            block_size=self.block_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            dtype=self.dtype,
            layout=KVCacheLayout[self.layout],
            rejected=REJECTED.get(self.batch),
            variant=self.attention,
            kv_cache_dtype=self.kv_cache_dtype,
        )


DEVICE_METADATA = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
"""The ``CommonAttentionMetadata`` tensors vLLM keeps on its device (the ``*_cpu`` ones are its host copies)."""


def forward(cls: type, case: Case, dtype: torch.dtype, what: str, host_reads: bool = True) -> list[torch.Tensor]:
    """Build the metadata with ``cls``'s builder, run every layer through its impl; vLLM's ``output`` per layer.

    With ``host_reads=False`` what vLLM keeps on its device (the metadata's device tensors, each layer's inputs)
    refuses host reads throughout the step (``attnhost.testing.host_reads``): a backend that declares graph
    support, and the adapter around it, must not wait on the device. An exception from the backend becomes an
    ``AssertionError`` whose first line says which step raised what (the cause stays chained).
    """
    spec = case.spec
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(len(case.caches))]
    config = VllmConfig(cache_config=CacheConfig(cache_dtype=case.kv_cache_dtype))
    common = case.metadata
    on_device = _as_is if host_reads else device_only
    if not host_reads:
        common = common.replace(**{name: device_only(getattr(common, name)) for name in DEVICE_METADATA})
    step = contextlib.nullcontext if host_reads else no_host_reads
    try:
        builder = cls.get_builder_cls()(spec, layer_names, config, "cpu")  # type: ignore[attr-defined]
        with step():
            metadata = builder.build(0, common)
    except Exception as exc:
        raise AssertionError(f"{what}: the metadata builder raised {type(exc).__name__}: {exc}") from exc
    outputs = []
    variant = case.variant
    for layer, cache in enumerate(case.caches):
        q, k, v = (on_device(t) for t in case.layer_inputs(layer, dtype))
        output = torch.full((q.shape[0], case.num_heads, spec.head_size), float("nan"), dtype=dtype)
        # vLLM's sinks are the model's parameter, in the model's dtype
        extra = {} if case.sinks is None else {"sinks": case.sinks[layer].to(dtype)}
        try:
            impl = cls.get_impl_cls()(  # type: ignore[attr-defined]
                case.num_heads,
                spec.head_size,
                spec.head_size**-0.5,
                spec.num_kv_heads,
                None,
                variant.sliding_window,
                case.kv_cache_dtype,
                variant.logits_soft_cap,
                AttentionType.DECODER,
                None,
                **extra,
            )
            with torch.no_grad(), step():
                returned = impl.forward(scaled_layer(case, layer), q, k, v, cache, metadata, output=output)
        except Exception as exc:
            raise AssertionError(f"{what}: forward (layer {layer}) raised {type(exc).__name__}: {exc}") from exc
        if returned is not output:
            raise AssertionError(f"{what}: forward (layer {layer}) returned a new tensor, not vLLM's output buffer")
        outputs.append(output)
    return outputs


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def scaled_layer(case: Case, layer: int) -> torch.nn.Module | None:
    """What vLLM passes an impl as ``layer`` where the cache is FP8: a module with vLLM's scale buffers
    (``_k_scale`` / ``_v_scale`` and their ``*_float`` copies, set by vLLM's own helper, then to the case's scales).
    ``None`` for a float cache, as vLLM's kernels ignore the scales there."""
    if case.scales is None:
        return None
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    module = torch.nn.Module()
    set_default_quant_scales(module, register_buffer=True)
    k_scale, v_scale = case.scales[layer]
    buffers = dict(module.named_buffers())
    buffers["_k_scale"].fill_(k_scale)
    buffers["_v_scale"].fill_(v_scale)
    module.__dict__.update(_k_scale_float=k_scale, _v_scale_float=v_scale)  # plain floats, as vLLM keeps them
    return module


def problem(case: Case, outputs: list[torch.Tensor], before: list[torch.Tensor], atol: float) -> str | None:
    """What is wrong with the outputs and the caches (``before``: the caches' contents before the forward)."""
    n = case.num_tokens
    starts = [0]
    for r in case.requests:
        starts.append(starts[-1] + r.query)
    kept = torch.tensor([r.written(p) for r in case.requests for p in range(r.prefix, r.seq)])
    for layer, output in enumerate(outputs):
        got = output[:n].double()
        ref = case.reference(layer)
        got[~kept] = ref[~kept]  # a rejected token's output is discarded: anything finite or not will do
        if not bool(torch.isfinite(got).all()):
            token = int((~torch.isfinite(got)).flatten().nonzero()[0]) // (got.shape[1] * got.shape[2])
            return f"output not finite (or never written) at {_where(case, starts, token, layer)}"
        excess = (got - ref).abs() - atol * ref.abs()
        if float(excess.max()) > atol:
            flat = int(excess.flatten().argmax())
            token, rest = divmod(flat, got.shape[1] * got.shape[2])
            error = float((got - ref).abs().flatten()[flat])
            return (
                f"max abs error {error:.1e} exceeds {atol:.0e} (+{atol:.0e}*|ref|) "
                f"({_where(case, starts, token, layer)}, head {rest // got.shape[2]})"
            )
    d = case.spec.head_size
    for layer, cache in enumerate(case.caches):
        written = torch.zeros(cache.shape[0], cache.shape[2], dtype=torch.bool)  # [block, offset]
        for i, r in enumerate(case.requests):
            for p in filter(r.written, range(r.prefix, r.seq)):
                block, offset = case.slot(r, p)
                written[block, offset] = True
                k, v = case.cached(layer, r, p)
                for which, got_kv, want in (("K", k, r.k[layer][p]), ("V", v, r.v[layer][p])):
                    diff = float((got_kv.double() - want).abs().max())
                    if diff != 0:
                        return (
                            f"KV cache, layer {layer}: block {block} offset {offset} (slot_mapping of request {i}, "
                            f"token {p - r.prefix} of {r.query}) does not hold that token's new {which} "
                            f"(max abs diff {diff:.1e}); write K/V where slot_mapping says, into this layer's cache"
                        )
        changed = (cache != before[layer]).any(dim=3).any(dim=1) & ~written  # logical [block, head, offset, 2D]
        if bool(changed.any()):
            block, offset = (int(x) for x in changed.nonzero()[0])
            return (
                f"KV cache, layer {layer}: block {block} offset {offset} changed, but no new token's slot is there "
                f"(slot_mapping marks padded and rejected rows with -1: skip them; write only the new tokens' slots; "
                f"head size {d})"
            )
    return None


def _where(case: Case, starts: list[int], token: int, layer: int) -> str:
    request = bisect.bisect_right(starts, token) - 1
    return f"layer {layer}, request {request}, token {token - starts[request]} of {case.requests[request].query}"


def check(cls: type, fcase: ForwardCase, what: str, host_reads: bool = True) -> None:
    """Run ``fcase`` through ``cls``; raise ``AssertionError`` with one line naming what broke and by how much
    (``host_reads=False``: with vLLM's device tensors refusing host reads, see :func:`forward`)."""
    case = fcase.make()
    before = [cache.clone() for cache in case.caches]
    outputs = [out.as_subclass(torch.Tensor) for out in forward(cls, case, fcase.dtype, what, host_reads)]
    found = problem(case, outputs, before, ATOL[fcase.dtype])
    if found is not None:
        raise AssertionError(f"{what}: {found}")
