"""SGLang's own MLA attention kit against attnhost's MLA-capable backends, and the bridge's MLA parts in process.

The kit (``sglang.test.kits.attention_unittest.attention_methods.mla_attention``,
driven by the test kit's ``attnhost_sglang_cpu.mla_kit``) builds each backend by
name through SGLang's ``ATTENTION_BACKENDS`` for a runner with
``use_mla_backend``, on a real ``MLATokenToKVPool`` with shuffled pages, calls
the absorbed form through a real ``RadixAttention`` and compares with its own
reference. The names resolve to attnhost's MLA adapter only because SGLang's
own ``load_plugins()`` ran attnhost's entry point.

Besides the kit: the adapter hands the backend SGLang's latent buffer itself;
a backend that does not declare ``mla`` and a quantized latent cache are
refused when the runner builds the backend, by name; DeepSeek's
``AttentionBackendRegistry`` knows attnhost's MLA-capable names (and only
those), with a handler choosing the MHA form exactly for prefills without a
cached prefix, and SGLang's own handlers untouched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.dense import DTYPES  # noqa: E402
from attnhost_sglang_cpu.mla_kit import ROPE_DIMS, build_mla_fixture, mla_cases, run_mla_case  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.models.deepseek_common.attention_backend_handler import (  # noqa: E402
    AttentionBackendRegistry,
    handle_attention_triton,
)
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (  # noqa: E402
    AttnForwardMethod,
)

from attnhost.backend import capabilities_of  # noqa: E402
from attnhost.engines.sglang.bridge import current_plan  # noqa: E402
from attnhost.engines.sglang.mla import SGLangMLAAdapterBackend, handle_attention_attnhost  # noqa: E402
from attnhost.errors import UnsupportedFeatureError  # noqa: E402


def _exported() -> dict[str, bool]:
    """Every exported SGLang name of an attnhost backend, with whether that backend declares ``mla``."""
    plan = current_plan()
    assert plan is not None, "attnhost's SGLang plugin did not run"
    return {
        name: capabilities_of(backend.entry.spec.load()).mla
        for backend in plan.backends
        for name in backend.engine_names
    }


MLA_BACKENDS = tuple(name for name, mla in _exported().items() if mla)
DENSE_ONLY = "tiny"  # an example plugin with dense attention only
MLA_EXAMPLE = "batched_matmul"  # an example plugin that serves MLA with kernels of its own

CASES = [
    pytest.param(backend, dtype, rope, case, id=f"{backend}-{str(dtype).removeprefix('torch.')}-rope{rope}-{case.name}")
    for backend in MLA_BACKENDS
    for dtype in DTYPES
    for rope in ROPE_DIMS
    for case in mla_cases(backend)
]


def test_the_built_in_backend_and_one_example_are_mla_capable_and_the_dense_example_is_not() -> None:
    assert "attnhost_torch_native" in MLA_BACKENDS
    assert MLA_EXAMPLE in MLA_BACKENDS, f"the example plugin's {MLA_EXAMPLE} is not installed or not MLA-capable"
    assert DENSE_ONLY not in MLA_BACKENDS


@pytest.mark.parametrize(("backend", "dtype", "rope", "case"), CASES)
def test_mla_case(backend: str, dtype: torch.dtype, rope: int, case: object) -> None:
    run_mla_case(case, dtype, rope)


@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_the_kit_builds_the_mla_adapter_over_sglangs_latent_buffer(backend: str) -> None:
    assert ATTENTION_BACKENDS[backend].__module__ == "attnhost.engines.sglang.bridge"
    case = mla_cases(backend)[0]
    first, second = build_mla_fixture(case), build_mla_fixture(case)
    assert isinstance(first.backend, SGLangMLAAdapterBackend)
    assert first.backend.attnhost_backend is not second.backend.attnhost_backend  # one attnhost backend per runner
    pool, kv = first.runner.token_to_kv_pool, first.backend._kv
    # zero-copy: the keys are SGLang's latent rows, the values a view of their first kv_lora_rank columns
    assert kv.k_buffer(0).data_ptr() == pool.get_key_buffer(0).data_ptr() == pool.kv_buffer[0].data_ptr()
    assert kv.v_buffer(0).data_ptr() == pool.kv_buffer[0].data_ptr()
    assert kv.v_buffer(0).shape[-1] == pool.kv_lora_rank and kv.k_buffer(0).shape[-1] == pool.kv_lora_rank + 16
    assert kv.req_to_token.data_ptr() == first.runner.req_to_token_pool.req_to_token.data_ptr()


def test_a_backend_without_mla_is_refused_by_name_when_the_runner_builds_it() -> None:
    case = mla_cases(DENSE_ONLY)[0]
    with pytest.raises(UnsupportedFeatureError) as refused:
        build_mla_fixture(case)
    message = str(refused.value)
    assert "'tiny'" in message and "MLA model" in message and "BackendCapabilities.mla" in message, message
    assert "attnhost_torch_native" in message, message  # the way out names a backend that declares it


def test_a_quantized_latent_cache_is_refused_by_name() -> None:
    from attnhost_sglang_cpu.dense import KitCase
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import build_mla_attention_fixture

    case = mla_cases("attnhost_torch_native")[0]
    with pytest.raises(
        UnsupportedFeatureError, match=r"attnhost_torch_native.*FP8 latent KV cache.*--kv-cache-dtype auto"
    ):
        build_mla_attention_fixture(KitCase(), case, device="cpu", dtype=torch.bfloat16, fp8_kv_cache=True)


def test_deepseek_dispatch_knows_attnhosts_mla_names_only() -> None:
    handlers = AttentionBackendRegistry._handlers
    for name, mla in _exported().items():
        assert (handlers.get(name) is handle_attention_attnhost) == mla, name
    assert AttentionBackendRegistry.get_handler("triton") is handle_attention_triton  # SGLang's own, untouched
    assert all(
        handler is not handle_attention_attnhost for name, handler in handlers.items() if name not in _exported()
    )


FORMS = {  # SGLang's MLA case -> the form attnhost's handler must pick
    "mla_extend_zero_prefix_exact_page": AttnForwardMethod.MHA,  # a prefill, no cached prefix
    "mla_extend_zero_prefix_input_page_edges": AttnForwardMethod.MHA,
    "mla_extend_page_size_1": AttnForwardMethod.MLA,  # cached prefixes
    "mla_extend_ragged_page_boundary": AttnForwardMethod.MLA,  # one request without a prefix, two with
    "mla_decode_page_boundary": AttnForwardMethod.MLA,
}


@pytest.mark.parametrize(("name", "expected"), [pytest.param(n, f, id=n) for n, f in FORMS.items()])
def test_deepseek_dispatch_picks_the_form_the_backend_serves(name: str, expected: AttnForwardMethod) -> None:
    [case] = [c for c in mla_cases("attnhost_torch_native") if c.name == name]
    fixture = build_mla_fixture(case)
    handler = AttentionBackendRegistry.get_handler("attnhost_torch_native")
    assert handler(fixture.actual_module, fixture.forward_batch) is expected, case.name


def test_one_head_per_rank_tells_the_forms_apart_by_the_call() -> None:
    """With one query head per rank and ``qk_nope == v == kv_lora_rank`` (the kit's model), both of SGLang's layer
    objects have the same shape: the absorbed call (the kit's, ``k = None``) must still read the cache, and an MHA
    call (``k``/``v`` given, ``save_kv_cache=False``, as DeepSeek's prefill makes it) must attend over its
    arguments."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    [base] = [c for c in mla_cases("attnhost_torch_native") if c.name == "mla_extend_zero_prefix_exact_page"]
    case = dataclasses.replace(base, name="one_head", num_heads=1)
    run_mla_case(case, torch.float32, 16)  # the absorbed form, through the kit

    fixture = build_mla_fixture(case, qk_rope_head_dim=16)
    rank, rope, tokens = 32, 16, case.num_input_tokens
    mha = RadixAttention(1, rank + rope, 0.3, num_kv_heads=1, layer_id=0, v_head_dim=rank)
    generator = torch.Generator().manual_seed(7)
    q, k = (torch.randn(tokens, 1, rank + rope, generator=generator) for _ in range(2))
    v = torch.randn(tokens, 1, rank, generator=generator)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(fixture.forward_batch)
        out = mha(q, k, v, fixture.forward_batch, save_kv_cache=False)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(out.view(tokens, 1, rank), expected)


def test_an_mla_kernel_that_raises_is_named_with_its_plugin_form_and_layer() -> None:
    """The dense paths' rule on the MLA path too: a plugin's exception becomes one line naming who failed where."""
    import re

    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import run_mla_fixture_eager

    from attnhost import BackendFailedError

    fixture = build_mla_fixture(mla_cases("attnhost_torch_native")[0])
    error = ValueError("illegal instruction")

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    backend = fixture.backend.attnhost_backend
    backend.forward_mla_mqa = backend.forward_mla_mha = fail  # the kernels of a plugin that breaks on this machine
    with pytest.raises(BackendFailedError) as caught:
        run_mla_fixture_eager(fixture)
    assert caught.value.__cause__ is error
    pattern = (
        r"^attnhost backend 'torch_native' \(plugin 'builtin' .*--attention-backend 'attnhost_torch_native' failed "
        r"in forward_mla_m[hq]a \((EXTEND|DECODE|MIXED) batch, layer 0\): ValueError: illegal instruction"
    )
    assert re.search(pattern, str(caught.value)), str(caught.value)
