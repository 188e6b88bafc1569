"""attnhost's float64 reference on SGLang's own batches and cache, at attnhost's dtype-aware tolerance.

SGLang's dense kit compares with ``atol = rtol = 3e-2`` in every dtype, so a
backend whose output is 1 % off passes it in float32, and a 1 % error does not
change a tiny model's greedy ids either. This check builds the same fixture
(SGLang's ``ReqToTokenPool`` / ``MHATokenToKVPool`` with shuffled pages, its
``ForwardBatch``, its ``RadixAttention``), runs the backend's attention alone
(the output projection would blur the error), and holds the output to
:func:`attnhost.testing.reference.reference_request_attention` at the
conformance kit's tolerance for the dtype. Keys and values come from a copy of
the cache taken before the backend ran, with the new tokens written by this
check, so a backend cannot make its own output look right by reading back a
wrong write. A failure names the backend, the case, the error and where it
is, and the usual mistake it matches (:mod:`attnhost.testing.diagnose`).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import torch
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import build_dense_attention_fixture

from attnhost.testing.conformance import BackendConformance
from attnhost.testing.diagnose import LayerFacts, RequestView, diagnose
from attnhost.testing.reference import reference_request_attention
from attnhost_sglang_cpu.dense import KitCase

__all__ = ["TOLERANCE", "ReferenceProblem", "reference_problem"]

#: The conformance kit's max abs error against the float64 reference, per dtype (a plugin author's overrides of
#: these class attributes apply to their own conformance tests; the engine kit holds every backend to the defaults).
TOLERANCE = {
    torch.float32: BackendConformance.float32_atol,
    torch.bfloat16: BackendConformance.bfloat16_atol,
    torch.float16: BackendConformance.float16_atol,
}


@dataclasses.dataclass(frozen=True)
class ReferenceProblem:
    """A failed check: the whole message, and apart the usual mistake the output matches (if one does), which a
    failure of SGLang's own check on the same case is given too."""

    message: str
    why: str | None = None


def reference_problem(case: Any, dtype: torch.dtype, backend: str) -> ReferenceProblem | None:
    """What is wrong with *backend*'s attention on SGLang's dense *case* in *dtype*, or ``None`` when it is within
    attnhost's tolerance of the float64 reference."""
    with torch.no_grad():
        fixture = build_dense_attention_fixture(KitCase(), case, device="cpu", dtype=dtype)
        batch, attn, module = fixture.forward_batch, fixture.actual_module.attn, fixture.actual_module
        heads, kv_heads, dim = attn.tp_q_head_num, attn.tp_k_head_num, attn.head_dim
        q, k, v = module.project_qkv(fixture.input_hidden)
        pool = fixture.runner.token_to_kv_pool
        k_cache = pool.get_key_buffer(attn.layer_id).clone()
        v_cache = pool.get_value_buffer(attn.layer_id).clone()
        k_cache[batch.out_cache_loc] = k.view(-1, kv_heads, dim).to(k_cache.dtype)
        v_cache[batch.out_cache_loc] = v.view(-1, kv_heads, dim).to(v_cache.dtype)
        with forward_context(ForwardContext(attn_backend=fixture.backend)):
            fixture.backend.init_forward_metadata(batch)
            out = attn(q, k, v, batch)
    label = f"backend {backend!r}, SGLang dense case {case.name!r} ({str(dtype).removeprefix('torch.')})"
    if tuple(out.shape) not in ((q.shape[0], heads * dim), (q.shape[0], heads, dim)):
        return ReferenceProblem(
            f"{label}: attention output shape {tuple(out.shape)}, expected ({q.shape[0]}, {heads * dim})"
        )
    q = q.view(-1, heads, dim)
    requests, starts = _requests(fixture, q, k_cache, v_cache)
    facts = LayerFacts(heads, kv_heads, attn.scaling, attn.sliding_window_size, float(attn.logit_cap or 0.0))
    expected = torch.cat([_reference(request, facts) for request in requests])
    got = out.detach().to("cpu", torch.float64).view(-1, heads, dim)
    diff = (got - expected).abs()
    error, atol = float(diff.max()), TOLERANCE[dtype]
    if error <= atol:  # a NaN fails too
        return None
    token, rest = divmod(int(diff.flatten().argmax()), heads * dim)
    request = bisect.bisect_right(starts, token) - 1
    where = f"request {request}, token {token - starts[request]} of {requests[request].q.shape[0]}, head {rest // dim}"
    why = diagnose(got, requests, facts, atol)
    return ReferenceProblem(
        f"{label}: max abs error {error:.1e} against attnhost's float64 reference exceeds {atol:.0e} ({where}; "
        f"SGLang's own check allows 3e-2){'; ' + why if why else ''}",
        why,
    )


def _requests(
    fixture: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[list[RequestView], list[int]]:
    """The batch's requests as the reference reads them, from SGLang's own batch and request-to-token table."""
    batch = fixture.forward_batch
    table = fixture.runner.req_to_token_pool.req_to_token
    seq_lens = batch.seq_lens_cpu.tolist()
    decode = batch.forward_mode.is_decode()
    new_lens = [1] * len(seq_lens) if decode else list(batch.extend_seq_lens_cpu)
    requests, starts, start = [], [], 0
    for i, (seq_len, new) in enumerate(zip(seq_lens, new_lens, strict=True)):
        slots = table[int(batch.req_pool_indices[i]), :seq_len].to(torch.int64)
        requests.append(RequestView(q[start : start + new], k_cache[slots], v_cache[slots], seq_len - new))
        starts.append(start)
        start += new
    return requests, starts


def _reference(request: RequestView, facts: LayerFacts) -> torch.Tensor:
    return reference_request_attention(
        request.q,
        request.k,
        request.v,
        prefix_len=request.prefix_len,
        scaling=facts.scaling,
        sliding_window_size=facts.sliding_window_size,
        logit_cap=facts.logit_cap,
    )
