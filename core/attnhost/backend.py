"""The contract every attention backend implements, and the layer it is called for: no torch import, as plugins
subclass ``AttentionBackend`` at import time and discovery must not pay for torch."""

from __future__ import annotations

import abc
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from attnhost.errors import BackendUnavailableError, describe_exception, safe_repr
from attnhost.forward_mode import ForwardMode
from attnhost.kv_cache import KVCache, _OnDevice

if TYPE_CHECKING:
    from torch import Tensor

    from attnhost.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "AttentionLayer", "AttentionRunner", "BackendCapabilities", "KVCache", "build_backend"]

FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


class AttentionRunner(_OnDevice, Protocol):
    """What a backend factory receives: a ``ModelRunner`` or an engine bridge's look-alike: one factory serves all."""

    @property
    def is_draft(self) -> bool: ...

    @property
    def kv_pool(self) -> KVCache: ...


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend declares it supports (fields: README's plugin guide), so engines refuse the rest before they
    build or capture anything. What the contract itself lacks (sliding window, logit cap, ALiBi, sinks, MLA,
    cross-attention) is refused for every backend rather than declared here."""

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

    def __post_init__(self) -> None:
        for flag in ("cuda_graph", "flat_heads", "tree_mask"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"BackendCapabilities.{flag} must be True or False, got {getattr(self, flag)!r}")
        dtypes, head_dims = self.dtypes, self.head_dims
        if isinstance(dtypes, str) or not dtypes or not all(isinstance(d, str) and d for d in dtypes):
            raise ValueError(f"BackendCapabilities.dtypes must be dtype names such as 'float16', got {dtypes!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in head_dims):
            raise ValueError(f"BackendCapabilities.head_dims must be positive integers, got {head_dims!r}")
        object.__setattr__(self, "dtypes", tuple(dtypes))
        object.__setattr__(self, "head_dims", tuple(head_dims))

    def refusal(self, *, dtype: str, head_dim: int, kv_dtype: str | None = None) -> str | None:
        """Why a model with these properties cannot run on this backend, or ``None`` if it can."""
        for what, name in (("dtype", dtype), ("KV-cache dtype", kv_dtype)):
            if name is not None and name not in self.dtypes:
                return f"{what} {name} (it supports {', '.join(self.dtypes)})"
        if self.head_dims and head_dim not in self.head_dims:
            return f"head dim {head_dim} (it supports {', '.join(map(str, self.head_dims))})"
        return None


def capabilities_of(factory: object) -> BackendCapabilities:
    """The capabilities a loaded factory declares (a class attribute), else the conservative default."""
    declared = getattr(factory, "capabilities", None)
    return declared if isinstance(declared, BackendCapabilities) else BackendCapabilities()


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """The per-layer facts a backend needs (SGLang's ``RadixAttention`` fields); ``scaling <= 0`` means
    ``1/sqrt(head_dim)``, and consecutive groups of query heads share a KV head (GQA, MQA)."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float = -1.0

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layer {self.layer_id}: head counts and head_dim must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.layer_id}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.scaling <= 0:
            object.__setattr__(self, "scaling", 1.0 / math.sqrt(self.head_dim))


class AttentionBackend(abc.ABC):
    """Base class of attention backends: SGLang's ``AttentionBackend`` surface (shapes: README's plugin guide). Built as
    ``factory(runner)`` (a subclass is its own factory) once per model runner and never shared, so the runner stamps its
    two ``*_attention_backend_str`` names on the instance and dispatch reads no global (SGLang #28559). A subclass
    implements ``init_forward_metadata`` and ``forward_extend`` (else: ``TypeError``)."""

    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()  # override to declare more

    def __init__(self, runner: AttentionRunner | None = None) -> None:  # noqa: B027 - optional to override
        """Accept the runner so a subclass is a valid factory; the base keeps nothing."""

    @abc.abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-batch metadata once, before the layers run."""

    @abc.abstractmethod
    def forward_extend(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> Tensor:  # fmt: skip
        """Attention for new tokens that attend to a cached prefix and causally to each other."""

    def forward_decode(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> Tensor:  # fmt: skip
        """One new token per request: a case of extend, so ``forward_extend`` unless a decode kernel is faster."""
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> Tensor:  # fmt: skip
        mode = forward_batch.forward_mode
        if mode is ForwardMode.IDLE:
            return q.new_empty((0, layer.num_heads, layer.head_dim))
        if mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


# The live backends factories have handed to runners, by id (a virtual subclass without weak references: forever).
_handed_out: weakref.WeakValueDictionary[int, AttentionBackend] = weakref.WeakValueDictionary()
_unweakrefable: dict[int, AttentionBackend] = {}
_handed_out_lock = threading.Lock()


def build_backend(
    factory: Callable[[AttentionRunner], object], runner: AttentionRunner, *, where: str, way_out: str, owner: str
) -> AttentionBackend:
    """``factory(runner)``, each refusal a ``BackendUnavailableError`` (``where`` names runner, backend and plugin). One
    instance handed to two runners (a cached singleton) would make the target run the draft's backend (SGLang #28559),
    so the second hand-out is refused. Whatever the factory raises, ``SystemExit`` included, is wrapped."""
    try:
        backend = factory(runner)
    except (Exception, SystemExit) as exc:
        raise BackendUnavailableError(f"{where}: its factory raised {describe_exception(exc)}; {way_out}") from exc
    if not isinstance(backend, AttentionBackend):
        raise BackendUnavailableError(
            f"{where}: its factory returned {type(backend).__name__} {safe_repr(backend)}, not an "
            f"attnhost.AttentionBackend; report this to the maintainers of {owner}"
        )
    key = id(backend)
    with _handed_out_lock:
        if _handed_out.get(key) is backend or _unweakrefable.get(key) is backend:
            raise BackendUnavailableError(
                f"{where}: its factory returned an instance ({safe_repr(backend)}) it had already returned for "
                "another runner; every runner needs its own, or the target runs the draft's backend "
                f"(SGLang #28559) — report this to the maintainers of {owner}"
            )
        try:
            _handed_out[key] = backend
        except TypeError:  # no weak reference possible
            _unweakrefable[key] = backend
    return backend
