"""The contract every attention backend implements, and the layer it is called for: no torch import, as plugins
subclass ``AttentionBackend`` at import time and discovery must not pay for torch."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, final

from attnhost.errors import (
    UnsupportedFeatureError,
    bounded,
    safe_repr,
)
from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache, _OnDevice
from attnhost.mla import MLAConfig, MLAForm

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost.forward_batch import ForwardBatch

__all__ = [
    "FLOAT_DTYPES",
    "FP8_KV_DTYPES",
    "VARIANT_FEATURES",
    "AttentionBackend",
    "AttentionLayer",
    "AttentionRunner",
    "BackendCapabilities",
    "KVCache",
    "dtype_name",
]

FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
FP8_KV_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
"""The FP8 formats a KV cache may have (docs/kv-cache.md): stored = saturate(x / scale), read = stored * scale."""


def dtype_name(dtype: object) -> str:
    """A torch dtype as capabilities and messages name it (``torch.bfloat16`` -> ``"bfloat16"``); no torch import."""
    return str(dtype).removeprefix("torch.")


VARIANT_FEATURES: tuple[str, ...] = ("sliding_window", "logit_cap", "sinks", "non_causal")
"""The attention variants a layer may need and a backend may declare (``BackendCapabilities`` flags of those names)."""
_FEATURE_WORDS = {
    "sliding_window": "sliding-window attention",
    "logit_cap": "logit soft-capping",
    "sinks": "attention sinks",
    "non_causal": "non-causal (bidirectional) attention",
}


class AttentionRunner(_OnDevice, Protocol):
    """What a backend factory receives: a ``ModelRunner`` or an engine bridge's look-alike: one factory serves all."""

    @property
    def is_draft(self) -> bool: ...

    @property
    def kv_pool(self) -> KVCache: ...


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend declares it supports (fields: docs/plugin-guide.md), so engines refuse the rest before they
    build or capture anything. What the contract itself lacks (ALiBi, cross-attention, logit caps other than tanh)
    is refused for every backend rather than declared here."""

    dtypes: tuple[str, ...] = FLOAT_DTYPES
    head_dims: tuple[int, ...] = ()
    cuda_graph: bool = False
    flat_heads: bool = False
    """Also takes ``q`` as ``[T, num_heads * head_dim]`` and then returns ``[T, num_heads * head_dim]``: SGLang's
    own layout, which the bridge then passes through instead of paying a view each way per layer."""
    tree_mask: bool = False
    """Honours ``ForwardBatch.tree_mask`` (speculative trees, EAGLE ``topk > 1``: a new token sees the prefix and
    only its own ancestors among the new tokens), giving zeros for a query that sees no key at all (an all-False
    row without a prefix). Without it engines run speculative chains only and refuse a tree run when they resolve
    their arguments, never on a batch."""
    mla: bool = False
    """Serves multi-head latent attention (DeepSeek, Kimi): ``forward_mla_mha`` and ``forward_mla_mqa`` over a
    latent KV cache (docs/mla.md). Without it an MLA model is refused when its runner is built, never on a batch."""
    sliding_window: bool = False
    """Honours ``AttentionLayer.sliding_window_size`` (Gemma 2/3, gpt-oss, Mistral): a query sees only the keys at
    most that many positions before its own (docs/variants.md)."""
    logit_cap: bool = False
    """Honours ``AttentionLayer.logit_cap``: scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2)."""
    sinks: bool = False
    """Honours attention sinks (gpt-oss): layers with ``has_sinks`` are called with ``sinks=`` (a ``[num_heads]``
    logit per query head in the softmax's denominator), which its forward methods then accept."""
    non_causal: bool = False
    """Honours ``AttentionLayer.is_causal=False`` (DFlash drafts, bidirectional spans): a request's new tokens see
    each other in both directions."""
    kv_cache_dtypes: tuple[str, ...] | None = None
    """The KV-cache dtypes it reads (docs/kv-cache.md), FP8 ones (:data:`FP8_KV_DTYPES`) included; ``None``: a cache
    of any declared ``dtypes`` and no FP8 one, since an FP8 cache read as if it were plain is wrong by its scales."""
    page_sizes: tuple[int, ...] | None = None
    """The cache page sizes it reads (SGLang's ``--page-size``, vLLM's ``--block-size``); ``None``: any, as a
    backend that reads slots through ``req_to_token`` does not care how they were allocated."""

    def __post_init__(self) -> None:
        for field_name in ("dtypes", "head_dims", "kv_cache_dtypes", "page_sizes"):  # a generator is read once, here
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, (str, bytes, int, tuple)) and hasattr(value, "__iter__"):
                object.__setattr__(self, field_name, tuple(value))
        for flag in ("cuda_graph", "flat_heads", "tree_mask", "mla", *VARIANT_FEATURES):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"BackendCapabilities.{flag} must be True or False, got {getattr(self, flag)!r}")
        dtypes, head_dims = self.dtypes, self.head_dims
        if isinstance(dtypes, str) or not dtypes or not all(isinstance(d, str) and d for d in dtypes):
            raise ValueError(f"BackendCapabilities.dtypes must be dtype names such as 'float16', got {dtypes!r}")
        if quantized := [d for d in dtypes if d.startswith("float8")]:
            raise ValueError(
                f"BackendCapabilities.dtypes are the model's compute dtypes, and {', '.join(quantized)} is a cache "
                "format: list it in kv_cache_dtypes (with the model dtypes it is read into in dtypes)"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in head_dims):
            raise ValueError(f"BackendCapabilities.head_dims must be positive integers, got {head_dims!r}")
        object.__setattr__(self, "dtypes", tuple(dtypes))
        object.__setattr__(self, "head_dims", tuple(head_dims))
        kv_dtypes, pages = self.kv_cache_dtypes, self.page_sizes
        if kv_dtypes is not None:
            if isinstance(kv_dtypes, str) or not kv_dtypes or not all(isinstance(d, str) and d for d in kv_dtypes):
                raise ValueError(
                    "BackendCapabilities.kv_cache_dtypes must be dtype names such as 'bfloat16' or "
                    f"'float8_e4m3fn', or None, got {kv_dtypes!r}"
                )
            object.__setattr__(self, "kv_cache_dtypes", tuple(kv_dtypes))
        if pages is not None:
            if isinstance(pages, int) or not pages or not all(_positive_int(p) for p in pages):
                raise ValueError(
                    "BackendCapabilities.page_sizes must be positive integers (tokens per page), or None, "
                    f"got {pages!r}"
                )
            object.__setattr__(self, "page_sizes", tuple(pages))

    def reads_kv_cache_dtype(self, name: str) -> bool:
        """Whether it reads a cache of this dtype: one of ``kv_cache_dtypes``, or with none declared, of
        ``dtypes`` (never an FP8 one, whose stored values are not the model's)."""
        if self.kv_cache_dtypes is not None:
            return name in self.kv_cache_dtypes
        return name in self.dtypes and name not in FP8_KV_DTYPES

    def cache_refusal(self, *, kv_dtype: str | None = None, page_size: int | None = None) -> str | None:
        """Why it cannot read a cache of this dtype or page size, worded for an error, or ``None`` if it can."""
        if kv_dtype is not None and not self.reads_kv_cache_dtype(kv_dtype):
            declared = self.kv_cache_dtypes if self.kv_cache_dtypes is not None else self.dtypes
            what = "an FP8 KV cache" if kv_dtype in FP8_KV_DTYPES else "a KV cache"
            return (
                f"{what} of dtype {kv_dtype} (it reads KV caches of {', '.join(declared)}; "
                "BackendCapabilities.kv_cache_dtypes)"
            )
        if page_size is not None and self.page_sizes is not None and page_size not in self.page_sizes:
            sizes = ", ".join(map(str, self.page_sizes))
            return f"KV-cache page size {page_size} (it reads page sizes {sizes}; BackendCapabilities.page_sizes)"
        return None

    def refusal(
        self,
        *,
        dtype: str,
        head_dim: int,
        kv_dtype: str | None = None,
        mla: bool = False,
        page_size: int | None = None,
    ) -> str | None:
        """Why a model with these properties cannot run on this backend, or ``None`` if it can (``head_dims``
        constrains dense layers only: an MLA layer's dims are its latent's; the cache: :meth:`cache_refusal`)."""
        if mla and not self.mla:
            return "MLA models (multi-head latent attention; it does not declare BackendCapabilities.mla)"
        if dtype not in self.dtypes:
            return f"dtype {dtype} (it supports {', '.join(self.dtypes)})"
        cache = self.cache_refusal(kv_dtype=kv_dtype, page_size=page_size)
        if cache is not None:
            return cache
        if self.head_dims and head_dim not in self.head_dims and not mla:
            return f"head dim {head_dim} (it supports {', '.join(map(str, self.head_dims))})"
        return None

    def layer_refusal(self, layer: AttentionLayer) -> str | None:
        """The first attention variant of ``layer`` (:attr:`AttentionLayer.variant_features`) this backend does not
        declare, worded for an error (``"sliding-window attention (sliding_window_size=4095)"``), or ``None``."""
        for feature in layer.variant_features:
            if not getattr(self, feature):
                return f"{_FEATURE_WORDS[feature]} ({layer.variant_text(feature)}; it does not declare {feature})"
        return None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def capabilities_of(factory: object) -> BackendCapabilities:
    """The capabilities a loaded factory declares (a class attribute), else, where it declares none, the
    conservative default. A declaration that is not a :class:`BackendCapabilities`, or whose reading raises, is
    refused (``TypeError`` naming the factory): running a backend on defaults it did not declare would be a guess."""
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    way_out = "declare capabilities = BackendCapabilities(...) as a class attribute"
    try:
        declared = getattr(factory, "capabilities", None)
    except Exception as exc:
        raise TypeError(
            f"{name}.capabilities raised {type(exc).__name__}: {bounded(str(exc))} when read; {way_out}"
        ) from exc
    if declared is None:
        return BackendCapabilities()
    if not isinstance(declared, BackendCapabilities):
        raise TypeError(
            f"{name}.capabilities is a {type(declared).__name__} ({safe_repr(declared)}), not an "
            f"attnhost.BackendCapabilities; {way_out}"
        )
    return declared


_MAX_FP8_SCALE = 3.4028234663852886e38 / 57344.0
"""The largest FP8 scale whose read-back of FP8's largest value (float8_e5m2's 57344) is a finite float32."""
_MAX_LOGIT_CAP = 65504.0
"""float16's largest finite value: a larger soft-cap is not a number every model dtype can compute with."""


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """The per-layer facts a backend needs (SGLang's ``RadixAttention`` fields); ``scaling <= 0`` means
    ``1/sqrt(head_dim)`` (an MLA layer's: ``mla.default_scaling``), and consecutive groups of query heads share a KV
    head (GQA, MQA). ``head_dim`` is the QK head dim; ``v_head_dim`` (``<= 0``: ``head_dim``) differs from it only in
    MLA layers, which carry their model's ``mla`` facts and the ``mla_form`` they are called in
    (:meth:`for_mla` builds them).

    The attention variants (exact semantics: docs/variants.md), each of which a backend must declare in
    :class:`BackendCapabilities` before an engine lets a layer that needs it reach it, keep SGLang's
    ``RadixAttention`` names: ``sliding_window_size`` (``-1``: none) is the window's *left* extent, so a query at
    position ``p`` sees keys at positions ``p - sliding_window_size .. p`` — HF's and vLLM's ``sliding_window``
    minus one; ``logit_cap`` (``0``: none) caps scores as ``cap * tanh(score / cap)``; ``has_sinks`` says the layer
    is called with ``sinks=``; ``is_causal=False`` lets a request's new tokens see each other both ways."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float = -1.0
    v_head_dim: int = -1
    mla: MLAConfig | None = None
    mla_form: MLAForm | None = None
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    has_sinks: bool = False
    is_causal: bool = True
    k_scale: float = 1.0
    """An FP8 cache stores ``saturate(k / k_scale)`` and a backend reads ``stored * k_scale`` (docs/kv-cache.md);
    a float cache ignores it, as both engines do. SGLang's ``RadixAttention.k_scale``, vLLM's ``_k_scale``."""
    v_scale: float = 1.0
    """As ``k_scale``, for values."""

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
                raise ValueError(
                    f"layer {self.layer_id}: {name} must be a finite number > 0 (1.0: unscaled), got {scale!r}"
                )
            if scale > _MAX_FP8_SCALE:
                raise ValueError(
                    f"layer {self.layer_id}: {name}={scale!r} would read FP8's largest value (57344) back as more "
                    f"than float32 holds; scales are at most {_MAX_FP8_SCALE:.3g}"
                )
            object.__setattr__(self, name, float(scale))
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layer {self.layer_id}: head counts and head_dim must be positive")
        self._check_variant()
        if self.v_head_dim <= 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if (self.mla is None) != (self.mla_form is None):
            raise ValueError(
                f"layer {self.layer_id}: an MLA layer needs both mla (an MLAConfig) and mla_form (an MLAForm), "
                f"got mla={self.mla!r}, mla_form={self.mla_form!r}; build it with AttentionLayer.for_mla()"
            )
        if self.mla is not None and self.mla_form is not None:
            got = (self.num_kv_heads, self.head_dim, self.v_head_dim)
            problem = self.mla.shape_problem(self.layer_id, self.mla_form, got, self.num_heads)
            if problem is not None:
                raise ValueError(problem)
        elif self.v_head_dim != self.head_dim:
            raise ValueError(
                f"layer {self.layer_id}: v_head_dim={self.v_head_dim} differs from head_dim={self.head_dim}, which "
                "only MLA layers may do; give the layer its MLAConfig (AttentionLayer.for_mla())"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.layer_id}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        scaling = self.scaling
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
            raise ValueError(
                f"layer {self.layer_id}: scaling must be a finite number (<= 0: 1/sqrt(head_dim)), got {scaling!r}"
            )
        if self.scaling <= 0:
            default = self.mla.default_scaling if self.mla is not None else 1.0 / math.sqrt(self.head_dim)
            object.__setattr__(self, "scaling", default)

    def _check_variant(self) -> None:
        window = self.sliding_window_size
        if isinstance(window, bool) or not isinstance(window, int) or window < -1:
            raise ValueError(
                f"layer {self.layer_id}: sliding_window_size must be an integer >= 0 (keys a query sees before its "
                f"own position) or -1 (no window), got {window!r}; from HF's or vLLM's sliding_window W pass W - 1"
            )
        cap = self.logit_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
            raise ValueError(f"layer {self.layer_id}: logit_cap must be a finite number >= 0 (0: none), got {cap!r}")
        if cap > _MAX_LOGIT_CAP:
            raise ValueError(
                f"layer {self.layer_id}: logit_cap={cap!r} is beyond what float16 holds ({_MAX_LOGIT_CAP:g}), so "
                "cap * tanh(score / cap) overflows; a cap that large caps nothing: use 0 for none"
            )
        object.__setattr__(self, "logit_cap", float(cap))
        for flag in ("has_sinks", "is_causal"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"layer {self.layer_id}: {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.mla is not None and self.variant_features:
            raise ValueError(
                f"layer {self.layer_id}: an MLA layer with {', '.join(self.variant_features)}; the contract's MLA "
                "forms (docs/mla.md) are plain causal attention"
            )

    @property
    def variant_features(self) -> tuple[str, ...]:
        """The attention variants (:data:`VARIANT_FEATURES`) this layer needs, in that order; ``()``: plain causal."""
        needs = (self.sliding_window_size >= 0, self.logit_cap > 0, self.has_sinks, not self.is_causal)
        return tuple(feature for feature, needed in zip(VARIANT_FEATURES, needs, strict=True) if needed)

    def variant_text(self, feature: str) -> str:
        """How this layer sets one variant, for messages: ``"sliding_window_size=4095"``."""
        return {
            "sliding_window": f"sliding_window_size={self.sliding_window_size}",
            "logit_cap": f"logit_cap={self.logit_cap:g}",
            "sinks": "has_sinks=True",
            "non_causal": "is_causal=False",
        }[feature]

    @classmethod
    def for_mla(
        cls, mla: MLAConfig, form: MLAForm, layer_id: int, num_heads: int, scaling: float = -1.0
    ) -> AttentionLayer:
        """One model layer of an MLA model in one form (``scaling <= 0``: the model's default); a model builds
        both forms of each layer with the same ``layer_id``."""
        kv_heads, head_dim, v_head_dim = mla.shape(form, num_heads)
        return cls(layer_id, num_heads, kv_heads, head_dim, scaling, v_head_dim=v_head_dim, mla=mla, mla_form=form)


class AttentionBackend(abc.ABC):
    """Base class of attention backends: SGLang's ``AttentionBackend`` surface (shapes: docs/plugin-guide.md). Built as
    ``factory(runner)`` (a subclass is its own factory) once per model runner and never shared, so the runner stamps
    its two ``*_attention_backend_str`` names on the instance and dispatch reads no global (docs/architecture.md). A
    subclass implements ``init_forward_metadata`` and ``forward_extend`` (else: ``TypeError``)."""

    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()  # override to declare more

    def __init__(self, runner: AttentionRunner | None = None) -> None:  # noqa: B027 - optional to override
        """Accept the runner so a subclass is a valid factory; the base keeps nothing."""

    @abc.abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-batch metadata once, before the layers run. A backend that declares
        ``capabilities.cuda_graph`` reads no device value on the host here and, handed a batch object it planned
        before (a captured graph's, its tensors refreshed in place by the engine), refreshes that plan in place:
        the graph reads the same storage at every replay (docs/graphs.md)."""

    def init_graph_state(self, max_bs: int, max_num_tokens: int, max_context_len: int) -> None:  # noqa: B027
        """Called once before an engine captures graphs (only for a backend that declares ``cuda_graph``), with the
        largest batch, new-token count and request length any captured graph will see: allocate here the metadata
        buffers every graph step refreshes in place. The default allocates nothing."""

    @abc.abstractmethod
    def forward_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> Tensor:
        """Attention for new tokens that attend to a cached prefix and causally to each other (or as the layer's
        variants say: docs/variants.md). A backend that declares ``capabilities.sinks`` also accepts a keyword
        ``sinks`` (``[num_heads]``), passed for the layers with ``has_sinks`` and only for them."""

    def forward_decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """One new token per request: a case of extend, so ``forward_extend`` unless a decode kernel is faster."""
        if sinks is not None:
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)  # type: ignore[call-arg]
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_mla_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        """MLA's MHA form (docs/mla.md): ``q``/``k`` ``[T, heads, qk_head_dim]``, ``v`` ``[T, heads, v_head_dim]``,
        causal over the arguments (no request has a cached prefix), the cache untouched (the caller writes the
        latent); returns ``[T, heads, v_head_dim]``. Only backends that declare ``capabilities.mla`` implement it."""
        raise UnsupportedFeatureError(_no_mla(self))

    def forward_mla_mqa(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        q_rope: Tensor | None = None,
        k_rope: Tensor | None = None,
    ) -> Tensor:
        """MLA's absorbed form, every forward mode (docs/mla.md): ``q`` ``[T, heads, kv_lora_rank + rope]`` (or its
        first ``kv_lora_rank`` columns with ``q_rope`` the rest) over the cached latent rows of every request's
        prefix and new tokens, causally (or by ``tree_mask``); ``k`` is the new latent rows ``[T, 1, kv_lora_rank +
        rope]`` (or their first columns with ``k_rope`` the rest), written when ``save_kv_cache``; ``v`` is their
        first ``kv_lora_rank`` columns, redundant; returns ``[T, heads, kv_lora_rank]``."""
        raise UnsupportedFeatureError(_no_mla(self))

    @final
    def forward(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        q_rope: Tensor | None = None,
        k_rope: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Route by the layer's MLA form, then by mode: IDLE, DECODE, everything else (extend); ``sinks`` goes on
        to the mode's method only when given (a backend without ``capabilities.sinks`` never takes it).

        Final: SGLang calls ``forward_extend`` and ``forward_decode`` by name, vLLM and the kit call this router,
        so an override would run in some engines and not in others; a backend that overrides it is refused when it
        is built (:func:`attnhost.building.build_backend`)."""
        mode = forward_batch.forward_mode
        if mode is ForwardMode.IDLE:
            return q.new_empty((0, layer.num_heads, layer.v_head_dim))
        if layer.mla_form is MLAForm.ABSORBED:
            return self.forward_mla_mqa(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope)
        if layer.mla_form is MLAForm.MHA:
            if save_kv_cache or q_rope is not None or k_rope is not None or k is None or v is None:
                raise ValueError(_mha_form_misuse(layer))
            return self.forward_mla_mha(q, k, v, layer, forward_batch)
        if k is None or v is None or q_rope is not None or k_rope is not None:
            raise ValueError(
                f"layer {layer.layer_id} is a dense layer: it takes k and v and no q_rope/k_rope (those belong to "
                "MLA layers in the absorbed form: build the layer with AttentionLayer.for_mla())"
            )
        if sinks is not None:
            if not getattr(type(self).capabilities, "sinks", False):
                raise UnsupportedFeatureError(
                    f"attention backend {self.prefill_attention_backend_str or type(self).__qualname__!r} was passed "
                    "sinks= but does not declare BackendCapabilities.sinks; serve layers with sinks with a backend "
                    "that declares them (e.g. torch_native)"
                )
            if mode is ForwardMode.DECODE:
                return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)  # type: ignore[call-arg]
        if mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


def _no_mla(backend: AttentionBackend) -> str:
    name = backend.prefill_attention_backend_str or type(backend).__qualname__
    return (
        f"attention backend {name!r} does not implement MLA (multi-head latent attention): it does not declare "
        "BackendCapabilities.mla; serve the MLA model with a backend that declares it (e.g. torch_native)"
    )


def _mha_form_misuse(layer: AttentionLayer) -> str:
    return (
        f"layer {layer.layer_id} is an MLA layer in the MHA form: it takes k and v (decompressed, per head), no "
        "q_rope/k_rope, and save_kv_cache=False, since the caller writes the latent row into the cache itself "
        "(kv_pool.set_kv(layer_id, out_cache_loc, latent, latent[..., :kv_lora_rank]))"
    )
