"""An SGLang ``AttentionBackend`` that runs an attnhost backend on SGLang's own pools.

SGLang builds one adapter per model runner through its ``ATTENTION_BACKENDS``
registry, and each adapter builds its own attnhost backend, so the target
and the draft never share one (docs/architecture.md). This module is the
part SGLang calls: the constructor, the plan of each batch and the dispatch
of each layer; the rest lives in the module named for it:

* start-up: the runner and its pools (``runner_checks``) and the loaded
  model's layers (``model_checks``) are checked when the adapter is built,
  so a backend that cannot serve them is refused before any batch;
* per batch: SGLang's ``ForwardBatch`` becomes an attnhost
  :class:`~attnhost.ForwardBatch` (``batches``) whose KV cache is a thin
  view of SGLang's pools (``kv_views``): the buffers handed to the backend
  are SGLang's own tensors, never copies; graph steps go through
  ``graph_steps``;
* per layer: the adapter only looks the layer up in a dict and views ``q``
  and the result between SGLang's ``[tokens, heads * head_dim]`` and the
  contract's ``[tokens, heads, head_dim]``; a backend that declares
  ``flat_heads`` takes SGLang's layout itself and is spared both views (at
  about 2 us each on a CPU, they are a few per cent of a small decode call).

Attention variants (docs/variants.md): each layer's ``sliding_window_size``,
``logit_cap`` (tanh only), ``attn_type`` (``ENCODER_ONLY``: non-causal) and
``sinks=`` (gpt-oss passes them per call) become the layer's facts, once.
SGLang's hybrid sliding-window pool (``SWAKVPool``: the window layers' keys
in a smaller pool of their own, ``req_to_token`` naming full-pool slots) is
served by a second attnhost backend for the window layers, over a view whose
slot table is translated into the window pool once per batch: each backend
then sees one KV cache whose ``req_to_token`` is right for every layer it is
called for, as the contract has it.

An MLA model's runner gets the subclass in ``mla`` instead (the bridge
picks it), and this class refuses one. What the attnhost contract cannot
express is refused with one error naming the backend and the feature
(:class:`~attnhost.engines.identity.BackendIdentity`), at construction or
on the first layer or batch that needs it. Never a wrong number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as SGLangAttentionBackend
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from torch import Tensor

from attnhost.backend import AttentionBackend, AttentionLayer, BackendCapabilities
from attnhost.engines.identity import BackendIdentity
from attnhost.engines.runner_view import RunnerView
from attnhost.engines.sglang.batches import SGLangBatches
from attnhost.engines.sglang.graph_steps import GraphSteps
from attnhost.engines.sglang.kv_views import SGLangKVCache, SGLangWindowKVCache
from attnhost.engines.sglang.model_checks import check_model, layer_facts, refuse_variants
from attnhost.engines.sglang.runner_checks import check_runner, slots_per_layer
from attnhost.errors import BackendFailedError, InvalidBatchError, UnsupportedFeatureError
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch

__all__ = ["SGLangAdapterBackend", "UnsupportedFeatureError", "runner_flag"]


def runner_flag(model_runner: Any) -> str:
    """The flag that chose a runner's backend, for every way out a refusal names: a draft's is its own."""
    if getattr(model_runner, "is_draft_worker", False):
        return "--speculative-draft-attention-backend"
    return "--attention-backend"


class _Stamp:
    """A backend-name stamp SGLang writes on the adapter, written through to the attnhost backend inside."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, adapter: object, owner: type | None = None) -> str | None:
        return None if adapter is None else adapter.__dict__.get(self.name)

    def __set__(self, adapter: object, value: str | None) -> None:
        adapter.__dict__[self.name] = value
        for inner in (adapter.__dict__.get("attnhost_backend"), adapter.__dict__.get("window_backend")):
            if inner is not None:
                setattr(inner, self.name, value)


def _no_peers(needs: tuple[str, ...]) -> list[str]:
    """No other backend to suggest: an adapter built outside the bridge knows of no peers."""
    return []


class SGLangAdapterBackend(SGLangAttentionBackend):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's backend interface over one attnhost backend, built once per SGLang model runner."""

    call_keywords: ClassVar[frozenset[str]] = frozenset({"sinks"})
    """The keyword arguments of SGLang's attention call this adapter passes on; any other, given, is refused."""

    def __init__(
        self,
        model_runner: Any,
        *,
        engine_name: str,
        attnhost_name: str,
        origin: str,
        factory: Any,
        capabilities: BackendCapabilities,
        capable_peers: Callable[[tuple[str, ...]], list[str]] = _no_peers,
        distribution: str | None = None,
    ) -> None:
        super().__init__()
        self._capable_peers = capable_peers
        self.device = torch.device(model_runner.device)
        flag = runner_flag(model_runner)
        self.identity = BackendIdentity(
            engine_name, attnhost_name, origin, factory, capabilities, "SGLang", flag, distribution
        )
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self._check_runner(model_runner)
        self.data_type = getattr(model_runner, "dtype", None) or self.token_to_kv_pool.dtype
        self.kv_cache_dtype = self.token_to_kv_pool.dtype
        self._kv = SGLangKVCache(self.req_to_token_pool, self.token_to_kv_pool, self.device)
        self._num_slots = slots_per_layer(self.token_to_kv_pool)
        self.batches = SGLangBatches(self.identity, self._kv, self._num_slots)
        self._graphs = GraphSteps(self.batches)
        is_draft = bool(getattr(model_runner, "is_draft_worker", False))
        self.attnhost_backend = self.identity.build(RunnerView(self.device, self.data_type, is_draft, self._kv))
        # SGLang's hybrid pool: the window layers run on a backend of their own, over the window pool's view
        self._window_kv: SGLangWindowKVCache | None = None
        self.window_backend: AttentionBackend | None = None
        self._window_ids: frozenset[int] = frozenset()
        if isinstance(self.token_to_kv_pool, SWAKVPool):
            self._window_kv = SGLangWindowKVCache(self.req_to_token_pool, self.token_to_kv_pool, self.device)
            mapping = self.token_to_kv_pool.layers_mapping
            self._window_ids = frozenset(layer_id for layer_id, (_, swa) in mapping.items() if swa)
            self.window_backend = self.identity.build(
                RunnerView(self.device, self.data_type, is_draft, self._window_kv)
            )
        self._window_batch: ForwardBatch | None = None
        self._layers: dict[int, AttentionLayer] = {}
        self._sinks: dict[int, tuple[Tensor, int, Tensor]] = {}  # layer -> (SGLang's sinks, their version, passed)
        self._sglang_batch: SGLangBatch | None = None
        self._batch: ForwardBatch | None = None
        self._decode: bool | None = None  # the planned batch's method (see forward); None: SGLang's own dispatch
        if not getattr(model_runner, "use_mla_backend", False):
            walked = check_model(self.identity, model_runner, self.data_type, self._window_ids, capable_peers)
            for radix, layer in walked:
                self._register(radix, layer)

    def _check_runner(self, runner: Any) -> None:
        """Refuse, before anything is built, a runner this adapter cannot serve (``runner_checks``)."""
        check_runner(self.identity, runner, self._capable_peers)

    @property
    def engine_name(self) -> str:
        return self.identity.engine_name

    @property
    def attnhost_name(self) -> str:
        return self.identity.attnhost_name

    @property
    def origin(self) -> str:
        return self.identity.origin

    @property
    def flag(self) -> str:
        """The flag that chose this backend (``runner_flag``), which every way out names."""
        return self.identity.flag

    @property
    def capabilities(self) -> BackendCapabilities:
        """What the backend declares: its identity's, which every part of the adapter reads."""
        return self.identity.capabilities

    @capabilities.setter
    def capabilities(self, declared: BackendCapabilities) -> None:
        self.identity = self.batches.identity = replace(self.identity, capabilities=declared)

    @property
    def kv_view(self) -> SGLangKVCache:
        """The KV view the attnhost backend reads: SGLang's pools, through this adapter's slot table."""
        return self._kv

    def refuse(self, feature: str, way_out: str | None = None) -> UnsupportedFeatureError:
        return self.identity.refuse(feature, way_out)

    def failure(self, method: str, mode: ForwardMode, layer_id: int | None, exc: BaseException) -> BackendFailedError:
        return self.identity.failed(method, mode, layer_id, exc)

    # SGLang stamps the runner's resolved names on its backend after building it; the
    # attnhost backend inside carries the same stamps, so attnhost-side dispatch agrees with SGLang's.
    prefill_attention_backend_str = _Stamp()
    decode_attention_backend_str = _Stamp()

    # -- per batch ------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: SGLangBatch) -> None:
        """Translate SGLang's batch once, checked without a host sync (``batches``), then let the attnhost backend
        plan it; the CPU graph runner's decode batches run in its graphs' buffers (``graph_steps``)."""
        if forward_batch.forward_mode.is_idle():
            self._plan(forward_batch, None)
            return
        mode = self.batches.mode_of(forward_batch)
        self._kv.take_mark(forward_batch)
        batch = self._graphs.cpu_decode(forward_batch) if mode is ForwardMode.DECODE else None
        self._plan(forward_batch, self.batches.translate(forward_batch, mode) if batch is None else batch)

    def plan_draft_step(
        self,
        forward_batch: SGLangBatch,
        table: Tensor,
        prefix_lens: Tensor,
        prefix_bounds: tuple[int, ...],
        out_cache_loc: Tensor,
        step: int,
    ) -> None:
        """Draft decode step ``step`` of a multi-step round (``multistep.SGLangMultiStepDraftBackend``) over the
        round's slot table (``batches.SGLangBatches.draft_step``)."""
        self._kv.take_mark(forward_batch)
        self._plan(forward_batch, self.batches.draft_step(table, prefix_lens, prefix_bounds, out_cache_loc, step))

    def plan_graph_step(self, forward_batch: Any, batch: ForwardBatch) -> None:
        """Draft decode step of a captured round (``multistep``): the step's graph batch over the round's table
        (which the container set as this adapter's slot table)."""
        self._kv.take_mark(forward_batch)
        self._plan(forward_batch, batch)

    def _plan(self, forward_batch: SGLangBatch, batch: ForwardBatch | None) -> None:
        """Remember the batch SGLang planned and let the attnhost backend plan its translation."""
        self._sglang_batch = forward_batch
        self._batch = self._window_batch = None  # a refused or failed plan leaves no batch behind to run layers on
        if batch is not None and not self.identity.capabilities.cuda_graph:
            # the backend plans from exact host lengths: where the engine has only bounds, one read on its behalf
            batch = batch.with_exact_host_lengths()
        window_batch = None if batch is None or self._window_kv is None else self._window_twin(batch)
        for backend, planned in ((self.attnhost_backend, batch), (self.window_backend, window_batch)):
            if planned is not None and backend is not None:
                try:
                    backend.init_forward_metadata(planned)
                except (Exception, SystemExit) as exc:
                    raise self.failure("init_forward_metadata", planned.forward_mode, None, exc) from exc
        self._batch, self._window_batch = batch, window_batch
        mode = forward_batch.forward_mode
        self._decode = None if batch is None or mode.is_mixed() else mode.is_decode()

    def _window_twin(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch as the window layers' backend sees it: the same lengths over the hybrid pool's window part,
        each row's slots (and the write slots) translated from the full pool once, here, for every layer."""
        window_kv = self._window_kv
        assert window_kv is not None
        window_kv.physical = self._kv.physical
        width = max(batch.seq_lens_cpu)
        window_kv.translate(batch.kv_pool.req_to_token, batch.req_pool_indices, width)
        rows = torch.arange(batch.batch_size, dtype=torch.int64, device=batch.req_pool_indices.device)
        loc = self.token_to_kv_pool.translate_loc_from_full_to_swa(batch.out_cache_loc)
        return replace(batch, kv_pool=window_kv, req_pool_indices=rows, out_cache_loc=loc)

    # -- graphs (graph_steps.py, graphs.py, docs/graphs.md) ----------------------------

    def start_graphs(self, max_bs: int, max_num_tokens: int) -> None:
        """Refuse graphs this adapter cannot capture, at start-up, and let the backend allocate the buffers its
        graph steps refresh in place (``AttentionBackend.init_graph_state``)."""
        if not self.capabilities.cuda_graph:
            raise self._graphs.refuse()
        if self.window_backend is not None:
            raise self.refuse(
                "graph capture over SGLang's hybrid window pool (its window slots are translated per batch)",
                "run SGLang with --disable-cuda-graph or --disable-hybrid-swa-memory",
            )
        try:
            self.attnhost_backend.init_graph_state(max_bs, max_num_tokens, self.batches.table_shape[1])
        except (Exception, SystemExit) as exc:
            raise self.failure("init_graph_state", ForwardMode.DECODE, None, exc) from exc

    def _init_graphs(self, max_bs: int, max_num_tokens: int, cpu: bool) -> None:
        """Allocate the graphs' buffers once, for the largest captured batch."""
        self.start_graphs(max_bs, max(max_bs, max_num_tokens))
        self._graphs.allocate(max_bs, cpu)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._init_graphs(max_bs, max_num_tokens, cpu=False)

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._init_graphs(max_bs, max_num_tokens, cpu=True)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self._graphs.seq_len_fill()

    get_cpu_graph_seq_len_fill_value = get_cuda_graph_seq_len_fill_value

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """The host part of a graph step, before capture and before every replay (``graph_steps``): the step's
        batch in the graph's buffers, planned by the backend in place."""
        self._plan(forward_batch, self._graphs.step(forward_batch, in_capture))

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Nothing: every device tensor the layers read was refreshed in place out of the graph."""

    def init_forward_metadata_capture_cpu_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: Tensor,
        seq_lens: Tensor,
        out_cache_loc: Tensor,
        encoder_lens: Tensor | None,
        forward_mode: Any,
        spec_info: Any,
    ) -> None:
        """The CPU graph runner's capture of batch size ``bs``: the same host part as a CUDA capture."""
        if encoder_lens is not None:
            raise self.refuse("encoder tokens in the batch (cross-attention)")
        view = SimpleNamespace(
            batch_size=bs,
            forward_mode=forward_mode,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            spec_info=spec_info,
        )
        self.init_forward_metadata_out_graph(view, in_capture=True)

    def forward_mixed(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise self.refuse("the NPU mixed-batch path")

    def support_triton(self) -> bool:
        return False

    # -- per layer ------------------------------------------------------------------

    def forward(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        """SGLang's own dispatch (idle, decode, extend), decided once per batch in ``_plan`` instead of by two
        mode tests in every layer's call: with the layer's code cold, as a real layer's is after the MLP has
        streamed its weights, those tests took 26 us, against 450 us for a whole one-request 4,096-token decode
        on a compiled kernel (BENCHMARKS.md, "Compiled CPU kernel")."""
        decode = self._decode
        if decode is None or forward_batch is not self._sglang_batch:
            out: Tensor = super().forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            return out
        if decode:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    # SGLang calls these two by name (and plugins may hook them by name), so both stay real methods.
    def forward_extend(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        return self._run("forward_extend", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        return self._run("forward_decode", q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _preamble(
        self, q: Tensor, layer: RadixAttention, forward_batch: SGLangBatch, kwargs: dict[str, Any]
    ) -> ForwardBatch:
        """What every layer's call checks first, dense or MLA: the batch was planned, SGLang passed no argument
        this adapter does not pass on (:attr:`call_keywords`), and ``q`` has a row per new token (no padding)."""
        batch = self._batch
        if batch is None or (forward_batch is not self._sglang_batch and not self._same_batch(batch, forward_batch)):
            raise RuntimeError(f"{self.identity.where}: init_forward_metadata() was not called for this ForwardBatch")
        if kwargs:
            extra = sorted(n for n, value in kwargs.items() if value is not None and n not in self.call_keywords)
            if extra:
                raise self.refuse(f"the extra attention arguments {', '.join(extra)} (layer {layer.layer_id})")
        if q.shape[0] != batch.num_new_tokens:
            raise self.refuse(f"padded batches ({q.shape[0]} query rows for {batch.num_new_tokens} tokens)")
        return batch

    def _run(
        self,
        method: str,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        layer: RadixAttention,
        forward_batch: SGLangBatch,
        save_kv_cache: bool,
        kwargs: dict[str, Any],
    ) -> Tensor:
        batch = self._preamble(q, layer, forward_batch, kwargs)
        sinks = kwargs.get("sinks")
        facts = self._layers.get(layer.layer_id) or self._layer(layer, sinks is not None)
        backend: AttentionBackend | None = self.attnhost_backend
        if self._window_batch is not None and layer.layer_id in self._window_ids:  # the hybrid pool's window part
            backend, batch = self.window_backend, self._window_batch
        if save_kv_cache and (k is None or v is None):
            raise RuntimeError(
                f"{self.identity.where}: save_kv_cache=True but SGLang passed no K/V for layer {layer.layer_id}"
            )
        if k is not None and k.dim() != 3:  # RadixAttention already hands [tokens, kv_heads, head_dim]
            k = k.view(-1, facts.num_kv_heads, facts.head_dim)
        if v is not None and v.dim() != 3:
            v = v.view(-1, facts.num_kv_heads, facts.head_dim)
        passed = None if sinks is None and not facts.has_sinks else self._sinks_for(facts, sinks)
        forward = getattr(backend, method)
        tokens = q.shape[0]
        # a backend that declares flat_heads takes SGLang's [tokens, heads * dim] both ways: no views
        flat = self.identity.capabilities.flat_heads and q.dim() == 2
        query = q if flat else q.view(tokens, facts.num_heads, facts.head_dim)
        try:  # free when nothing raises; a plugin's exception gets the one line naming it
            if passed is None:
                out: Tensor = forward(query, k, v, facts, batch, save_kv_cache)
            else:
                out = forward(query, k, v, facts, batch, save_kv_cache, sinks=passed)
        except (Exception, SystemExit) as exc:
            raise self.failure(method, batch.forward_mode, layer.layer_id, exc) from exc
        return self._flat(out, q) if flat else out.reshape(tokens, -1)

    def _layer(self, layer: RadixAttention, has_sinks: bool = False) -> AttentionLayer:
        """The facts of a layer the start-up walk did not find, on its first forward (``has_sinks``: whether that
        call passed ``sinks=``), checked as the walk checks the others (``model_checks``)."""
        facts = layer_facts(self.identity, layer, has_sinks, self.data_type)
        refuse_variants(self.identity, facts, self._capable_peers)
        self._register(layer, facts)
        return facts

    def _register(self, layer: RadixAttention, facts: AttentionLayer) -> None:
        """Remember a layer's facts, and bind the layer in the KV view that writes its keys."""
        self._layers[facts.layer_id] = facts
        view = self._window_kv if self._window_kv is not None and facts.layer_id in self._window_ids else self._kv
        view.bind(layer)

    def _flat(self, out: Tensor, q: Tensor) -> Tensor:
        if out.dim() != 2:
            raise RuntimeError(
                f"{self.identity.where} declares flat_heads but returned shape {tuple(out.shape)} for a "
                f"[{q.shape[0]}, {q.shape[1]}] query; fix the plugin (the conformance kit checks this)"
            )
        return out

    def _sinks_for(self, layer: AttentionLayer, sinks: Tensor | None) -> Tensor:
        """SGLang's sinks as the contract takes them (a layer with sinks, ``has_sinks``, gets them on every call):
        ``[num_heads]`` in the layer's dtype or float32. gpt-oss keeps them in bfloat16 whatever the model's dtype,
        so those become float32, once per weight version (an in-place weight update bumps the tensor's version),
        not on every call."""
        if sinks is None or not layer.has_sinks:
            raise InvalidBatchError(
                f"{self.identity.where}: layer {layer.layer_id} was called "
                + (
                    "without sinks= although its attention module holds sinks"
                    if sinks is None
                    else "with sinks= although its attention module holds none"
                )
                + f"; nothing was read or written — {self.identity.engine_bug}"
            )
        cached = self._sinks.get(layer.layer_id)
        if cached is not None and cached[0] is sinks and cached[1] == sinks._version:
            return cached[2]
        if tuple(sinks.shape) != (layer.num_heads,):
            raise InvalidBatchError(
                f"{self.identity.where}: layer {layer.layer_id} was passed sinks of shape {tuple(sinks.shape)}, not "
                f"one per query head of this rank ({layer.num_heads},); nothing was read or written — "
                f"{self.identity.engine_bug}"
            )
        passed = sinks if sinks.dtype in (self.data_type, torch.float32) else sinks.to(torch.float32)
        self._sinks[layer.layer_id] = (sinks, sinks._version, passed)
        return passed

    def _same_batch(self, batch: ForwardBatch, forward_batch: SGLangBatch) -> bool:
        """Whether another ForwardBatch object describes the batch planned: SGLang's eager runner copies a
        pre-planned batch (draft steps, verify, draft-extend) into its static buffers and runs the layers on
        the copy. Same mode and the same write slots; checked once, then the copy is the planned batch."""
        planned, loc = self._sglang_batch, forward_batch.out_cache_loc
        if planned is None or loc is None or forward_batch.forward_mode != planned.forward_mode:
            return False
        if loc.shape != batch.out_cache_loc.shape or not torch.equal(loc.to(torch.int64), batch.out_cache_loc):
            return False
        self._sglang_batch = forward_batch
        return True
