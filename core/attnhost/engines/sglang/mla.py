"""attnhost backends serving SGLang's MLA models (DeepSeek V2/V3/R1, Kimi K2): the adapter over
``MLATokenToKVPool`` and DeepSeek's attention-method dispatch for attnhost names (docs/mla.md).

SGLang calls an MLA model's attention through two ``RadixAttention`` objects per layer, both with the layer's
id: ``attn_mha`` (``num_kv_heads == num_heads``, QK head dim ``qk_nope + qk_rope``, V head dim the model's
``v_head_dim``) for a prefill without a cached prefix, the model having written the latent rows itself; and
``attn_mqa`` (one KV head, QK head dim ``kv_lora_rank + qk_rope``, V head dim ``kv_lora_rank``) for everything
else. :class:`SGLangMLAAdapterBackend` recognises which of the two a layer object is, once, and calls the
attnhost backend's ``forward_mla_mha`` or ``forward_mla_mqa``; the latent cache it hands over is SGLang's own
buffer (``k_buffer`` the rows, ``v_buffer`` their first ``kv_lora_rank`` columns), never a copy.

Which of the two SGLang calls is DeepSeek's decision (``dispatch_attn_forward_method``), made per batch by a
handler registered under the backend's name in ``AttentionBackendRegistry``; an unregistered name silently gets
``triton``'s. :func:`register_deepseek_dispatch` registers :func:`handle_attention_attnhost` for every exported
attnhost name whose backend declares ``mla``, and never replaces a handler SGLang registered itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from attnhost.backend import AttentionLayer, dtype_name
from attnhost.dtypes import FP8_DTYPES
from attnhost.engines.sglang.adapter import SGLangAdapterBackend
from attnhost.engines.sglang.runner_checks import check_cache
from attnhost.mla import MLAConfig, MLAForm

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch
    from torch import Tensor

__all__ = ["SGLangMLAAdapterBackend", "handle_attention_attnhost", "register_deepseek_dispatch"]


class SGLangMLAAdapterBackend(SGLangAdapterBackend):
    """The adapter for a model runner with ``use_mla_backend``: both MLA forms over SGLang's latent pool."""

    call_keywords: ClassVar[frozenset[str]] = frozenset(("q_rope", "k_rope"))
    mla: MLAConfig

    def _check_runner(self, runner: Any) -> None:
        """Refuse, before any batch, a backend that does not declare ``mla`` and a latent pool it cannot read."""
        model_config = getattr(runner, "model_config", None)
        pool = self.token_to_kv_pool
        if not self.capabilities.mla:
            raise self.refuse(
                f"the MLA model {_model_name(model_config, pool)}: it does not declare BackendCapabilities.mla",
                f"choose with {self.flag} a backend that declares it (e.g. attnhost_torch_native)",
            )
        if type(pool) is not MLATokenToKVPool:
            raise self.refuse(f"SGLang's {type(pool).__name__} (it reads MLATokenToKVPool)")
        if getattr(pool, "use_dsa", False):
            raise self.refuse("DeepSeek sparse attention (an MLA pool with use_dsa)")
        if pool.store_dtype != pool.dtype or pool.dtype in FP8_DTYPES:
            raise self.refuse(
                f"an FP8 latent KV cache ({dtype_name(pool.dtype)} stored as {dtype_name(pool.store_dtype)}) for the "
                f"MLA model {_model_name(model_config, pool)}: attnhost's MLA latent cache stays float",
                "run SGLang with --kv-cache-dtype auto",
            )
        if pool.kv_cache_dim != pool.kv_lora_rank + pool.qk_rope_head_dim:
            raise self.refuse(f"a latent row of width {pool.kv_cache_dim} unlike kv_lora_rank + qk_rope_head_dim")
        rank, rope = int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)
        self.mla = MLAConfig(
            kv_lora_rank=rank,
            qk_rope_head_dim=rope,
            qk_nope_head_dim=int(getattr(model_config, "qk_nope_head_dim", None) or rank),
            v_head_dim=int(getattr(model_config, "v_head_dim", None) or rank),
        )
        model_dtype = dtype_name(getattr(runner, "dtype", pool.dtype))
        reason = self.capabilities.refusal(dtype=model_dtype, head_dim=self.mla.latent_dim, mla=True)
        if reason is not None:
            raise self.refuse(reason, f"choose another --dtype or {self.flag}")
        check_cache(self.identity, pool)
        self._mla_layers: dict[RadixAttention, AttentionLayer] = {}

    def _mla_layer(self, layer: RadixAttention, k: Tensor | None, save_kv_cache: bool) -> AttentionLayer:
        """The attnhost view of one of SGLang's two layer objects of an MLA layer, decided on its first call."""
        lid = layer.layer_id
        if (
            getattr(layer, "is_cross_attention", False)
            or getattr(getattr(layer, "attn_type", None), "name", "DECODER") != "DECODER"
        ):
            raise self.refuse(f"non-causal or cross-attention (layer {lid})")
        if (getattr(layer, "sliding_window_size", -1) or -1) > -1:
            raise self.refuse(f"sliding-window attention (layer {lid})")
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise self.refuse(f"logit capping (layer {lid}, logit_cap={layer.logit_cap})")
        heads = layer.tp_q_head_num
        got = (layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim)
        fits = [form for form in (MLAForm.ABSORBED, MLAForm.MHA) if self.mla.shape(form, heads) == got]
        if len(fits) == 2:  # one head per rank and nope == v == rank: the shapes agree, the call does not
            fits = [MLAForm.MHA if k is not None and not save_kv_cache else MLAForm.ABSORBED]
        if not fits:
            absorbed, mha = (self.mla.shape(form, heads) for form in (MLAForm.ABSORBED, MLAForm.MHA))
            raise self.refuse(
                f"MLA layer {lid} with (num_kv_heads, qk_head_dim, v_head_dim) = {got}: it is neither the absorbed "
                f"form {absorbed} nor the MHA form {mha} of this model's latent ({self.mla})",
                "report this to attnhost's maintainers",
            )
        converted = AttentionLayer.for_mla(self.mla, fits[0], lid, heads, float(layer.scaling))
        self._mla_layers[layer] = converted
        self._kv.bind(layer)  # either object names the layer to the pool's set_kv_buffer
        return converted

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
        mla_layer = self._mla_layers.get(layer) or self._mla_layer(layer, k, save_kv_cache)
        tokens = q.shape[0]
        if q.dim() != 3 and not self.capabilities.flat_heads:
            q = q.view(tokens, mla_layer.num_heads, -1)
        backend = self.attnhost_backend
        mha = mla_layer.mla_form is MLAForm.MHA
        decompressed = (k, v) if mha and not save_kv_cache and k is not None and v is not None else None
        if mha and decompressed is None:
            raise RuntimeError(
                f"{self.identity.where}: SGLang called MLA layer {layer.layer_id}'s MHA form with "
                f"save_kv_cache={save_kv_cache} and k/v {'missing' if k is None or v is None else 'given'}; "
                "the MHA form takes decompressed k/v and leaves the latent cache to the model"
            )
        try:  # a plugin's exception gets the one line naming it, as on the dense path
            if decompressed is not None:
                out: Tensor = backend.forward_mla_mha(q, *decompressed, mla_layer, batch)
            else:
                q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
                out = backend.forward_mla_mqa(q, k, v, mla_layer, batch, save_kv_cache, q_rope, k_rope)
        except (Exception, SystemExit) as exc:
            method = "forward_mla_mha" if mha else "forward_mla_mqa"
            raise self.failure(method, batch.forward_mode, layer.layer_id, exc) from exc
        return out if out.dim() == 2 else out.reshape(tokens, -1)


def _model_name(model_config: Any, pool: Any) -> str:
    """The model as an operator knows it: its path, architecture and latent shape."""
    name = getattr(model_config, "model_path", None) or type(model_config).__name__
    architectures = getattr(getattr(model_config, "hf_config", None), "architectures", None) or ["an MLA model"]
    rank, rope = getattr(pool, "kv_lora_rank", "?"), getattr(pool, "qk_rope_head_dim", "?")
    return f"{name} ({architectures[0]}; multi-head latent attention, kv_lora_rank {rank}, qk_rope_head_dim {rope})"


def handle_attention_attnhost(attn: Any, forward_batch: Any) -> Any:
    """DeepSeek's attention method for an attnhost backend: the MHA form for a prefill no request of which has a
    cached prefix (what ``forward_mla_mha`` serves), the absorbed form for everything else, and the absorbed form
    inside a captured prefill graph (one path, as SGLang's own handlers do)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _get_sum_extend_prefix_lens,
        is_in_breakable_cuda_graph,
        is_in_tc_piecewise_cuda_graph,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    if is_in_tc_piecewise_cuda_graph() or is_in_breakable_cuda_graph():
        return AttnForwardMethod.MLA
    if forward_batch.forward_mode.is_extend_without_speculative() and _get_sum_extend_prefix_lens(forward_batch) == 0:
        return AttnForwardMethod.MHA
    return AttnForwardMethod.MLA


def register_deepseek_dispatch(mla_names: Iterable[str]) -> list[str]:
    """Register :func:`handle_attention_attnhost` in DeepSeek's ``AttentionBackendRegistry`` under each of
    *mla_names* (exported attnhost names whose backends declare ``mla``); a name SGLang registered a handler for
    keeps SGLang's. Returns the names now served by attnhost's handler."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    handlers = AttentionBackendRegistry._handlers
    served = []
    for name in mla_names:
        if handlers.get(name, handle_attention_attnhost) is handle_attention_attnhost:
            AttentionBackendRegistry.register(name, handle_attention_attnhost)
            served.append(name)
    return served
