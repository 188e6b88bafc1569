"""SGLang #28528/#28559: target and draft runners each own their backend; dispatch never crosses.

The shape of the original crash: a target whose prefill and decode backends
differ (an MLA prefill kernel plus a decode kernel) and a draft on a third
backend. Built in either order, each runner must dispatch every forward mode
to its own backends, and the shared args must be untouched.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")  # the py312/py313 envs have no torch
pytestmark = pytest.mark.torch

import attnhost
from attnhost import (
    BackendSpec,
    ForwardMode,
    ModelRunner,
    NoForwardContextError,
    ServerArgs,
    dispatch_attention_backend,
    get_attn_backend,
)
from attnhost.testing.reference import reference_attention
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class _Recording(TorchNativeAttnBackend):
    """torch_native that records which kernel ran, to prove real attention was routed."""

    label = "base"

    def __init__(self, runner: object = None) -> None:
        super().__init__(runner)  # type: ignore[arg-type]
        self.calls: list[str] = []

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self.calls.append(f"{self.label}.extend")
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self.calls.append(f"{self.label}.decode")
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)


class MlaPrefill(_Recording):
    label = "mla_prefill"


class DenseDecode(_Recording):
    label = "dense_decode"


class DraftKernel(_Recording):
    label = "draft_kernel"


class _TestBackends:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(name="mla_prefill", factory=MlaPrefill, description="stand-in for an MLA prefill kernel"),
            BackendSpec(name="dense_decode", factory=DenseDecode, description="stand-in for a decode kernel"),
            BackendSpec(name="draft_kernel", factory=DraftKernel, description="stand-in for a draft kernel"),
        ]

    @attnhost.hookimpl
    def attnhost_draft_attention_backends(self) -> list[str]:
        return ["draft_kernel"]


@pytest.fixture
def backends() -> Iterator[None]:
    attnhost.register_plugin(_TestBackends(), name="test-backends")
    yield


def _args(mode: str = "prefill") -> ServerArgs:
    return ServerArgs(
        prefill_attention_backend="mla_prefill",
        decode_attention_backend="dense_decode",
        speculative_draft_attention_backend="draft_kernel",
        speculative_attention_mode=mode,  # type: ignore[arg-type]
    )


def _expected_target(mode: ForwardMode, spec_mode: str) -> str:
    if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        return "dense_decode"
    if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        return "dense_decode" if spec_mode == "decode" else "mla_prefill"
    return "mla_prefill"


@pytest.mark.usefixtures("backends")
@pytest.mark.parametrize("spec_mode", ["prefill", "decode"])
@pytest.mark.parametrize("draft_first", [False, True], ids=["target-first", "draft-first"])
def test_each_runner_dispatches_to_its_own_backends(spec_mode: str, draft_first: bool) -> None:
    args = _args(spec_mode)
    before = dataclasses.astuple(args)
    if draft_first:
        draft = ModelRunner(args, is_draft=True)
        target = ModelRunner(args)
    else:
        target = ModelRunner(args)
        draft = ModelRunner(args, is_draft=True)
    assert dataclasses.astuple(args) == before, "a runner wrote into the shared args"

    assert target.attn_backend is not draft.attn_backend
    assert isinstance(target.attn_backend, attnhost.HybridAttnBackend)
    assert (target.attn_backend.prefill_attention_backend_str, target.attn_backend.decode_attention_backend_str) == (
        "mla_prefill",
        "dense_decode",
    )
    assert isinstance(draft.attn_backend, DraftKernel)
    assert (draft.attn_backend.prefill_attention_backend_str, draft.attn_backend.decode_attention_backend_str) == (
        "draft_kernel",
        "draft_kernel",
    )
    for mode in ForwardMode:
        with target.forward_context():
            assert get_attn_backend() is target.attn_backend
            assert dispatch_attention_backend(mode) == _expected_target(mode, spec_mode), mode
            with draft.forward_context():  # nested: the draft runs inside the target's step
                assert get_attn_backend() is draft.attn_backend
                assert dispatch_attention_backend(mode) == "draft_kernel"
            assert dispatch_attention_backend(mode) == _expected_target(mode, spec_mode)
    assert attnhost.AttentionBackend.prefill_attention_backend_str is None  # nothing stamped on the class
    assert dataclasses.astuple(args) == before


def test_no_context_is_a_clear_error() -> None:
    with pytest.raises(NoForwardContextError, match="forward_context"):
        get_attn_backend()
    with pytest.raises(NoForwardContextError):
        dispatch_attention_backend(ForwardMode.DECODE)


@pytest.mark.usefixtures("backends")
def test_runners_used_concurrently_from_threads() -> None:
    args = _args("decode")
    target = ModelRunner(args)
    draft = ModelRunner(args, is_draft=True)
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def work(runner: ModelRunner, expect: dict[ForwardMode, str]) -> None:
        barrier.wait()
        for _ in range(2000):
            with runner.forward_context():
                for mode, name in expect.items():
                    got = dispatch_attention_backend(mode)
                    if got != name or get_attn_backend() is not runner.attn_backend:
                        errors.append(f"{runner!r}: {mode.name} -> {got}")
                        return

    target_expect = {m: _expected_target(m, "decode") for m in ForwardMode}
    draft_expect = dict.fromkeys(ForwardMode, "draft_kernel")
    threads = [
        threading.Thread(target=work, args=(target, target_expect)),
        threading.Thread(target=work, args=(draft, draft_expect)),
        threading.Thread(target=work, args=(target, target_expect)),
        threading.Thread(target=work, args=(draft, draft_expect)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]


@pytest.mark.usefixtures("backends")
@pytest.mark.parametrize("spec_mode", ["prefill", "decode"])
def test_hybrid_routes_real_attention(spec_mode: str) -> None:
    torch.manual_seed(0)
    runner = ModelRunner(_args(spec_mode), num_heads=4, num_kv_heads=2, head_dim=16)
    hybrid = runner.attn_backend
    assert isinstance(hybrid, attnhost.HybridAttnBackend)
    prefill, decode = hybrid.prefill_backend, hybrid.decode_backend
    assert isinstance(prefill, MlaPrefill) and isinstance(decode, DenseDecode)
    layer = runner.layers[0]
    reqs = [runner.new_request(), runner.new_request()]

    def run(mode: ForwardMode, triples: list[tuple[int, int, int]]) -> torch.Tensor:
        batch = runner.prepare_batch(mode, triples)
        n = batch.num_new_tokens
        q = torch.randn(n, layer.num_heads, layer.head_dim)
        k = torch.randn(n, layer.num_kv_heads, layer.head_dim)
        v = torch.randn(n, layer.num_kv_heads, layer.head_dim)
        with runner.forward_context():
            out = get_attn_backend().forward(q, k, v, layer, batch)
        expected = reference_attention(q, layer, batch)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        return out

    run(ForwardMode.EXTEND, [(reqs[0], 0, 5), (reqs[1], 0, 3)])
    assert prefill.calls == ["mla_prefill.extend"] and decode.calls == []
    run(ForwardMode.DECODE, [(reqs[0], 5, 1), (reqs[1], 3, 1)])
    # decode ran the decode method, which (not overridden by torch_native) is forward_extend
    assert decode.calls == ["dense_decode.decode", "dense_decode.extend"]
    run(ForwardMode.TARGET_VERIFY, [(reqs[0], 6, 3), (reqs[1], 4, 3)])
    if spec_mode == "decode":
        assert decode.calls[-1] == "dense_decode.extend" and len(prefill.calls) == 1
    else:
        assert prefill.calls[-1] == "mla_prefill.extend" and len(decode.calls) == 2
    idle = runner.prepare_batch(ForwardMode.IDLE, [])
    with runner.forward_context():
        empty = get_attn_backend().forward(
            torch.empty(0, 4, 16), torch.empty(0, 2, 16), torch.empty(0, 2, 16), layer, idle
        )
    assert empty.shape == (0, 4, 16)


def test_declared_only_backend_fails_clearly_at_the_runner() -> None:
    with pytest.raises(attnhost.BackendUnavailableError, match=r"'flashinfer'.*declared only.*flashinfer-python"):
        ModelRunner(ServerArgs(attention_backend="flashinfer"), platform="cpu")
    with pytest.raises(attnhost.BackendUnavailableError, match=r"draft runner.*'flashinfer'"):
        ModelRunner(ServerArgs(attention_backend="torch_native"), is_draft=True, platform="cpu")


def test_wrong_platform_and_missing_module_fail_clearly() -> None:
    class Gpu(TorchNativeAttnBackend):
        pass

    class Spec:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[BackendSpec]:
            return [
                BackendSpec(name="gpu_only", factory=Gpu, platforms=("cuda",)),
                BackendSpec(
                    name="needs_module", factory=Gpu, requires=("no_such_kernels",), provided_by="no-such-kernels"
                ),
                BackendSpec(name="bad_factory", factory=lambda runner: object()),
            ]

    attnhost.register_plugin(Spec(), name="spec")
    with pytest.raises(attnhost.BackendUnavailableError, match="runs on cuda, not cpu"):
        ModelRunner(ServerArgs(attention_backend="gpu_only"), platform="cpu")
    with pytest.raises(attnhost.BackendUnavailableError, match="pip install no-such-kernels"):
        ModelRunner(ServerArgs(attention_backend="needs_module"), platform="cpu")
    with pytest.raises(attnhost.BackendUnavailableError, match=r"not an attnhost\.AttentionBackend"):
        ModelRunner(ServerArgs(attention_backend="bad_factory"), platform="cpu")


def test_target_on_cpu_defaults_to_torch_native() -> None:
    runner = ModelRunner(ServerArgs(), platform="cpu")
    assert isinstance(runner.attn_backend, TorchNativeAttnBackend)
    with runner.forward_context():
        assert dispatch_attention_backend(ForwardMode.DECODE) == "torch_native"


def test_dispatch_allocates_nothing() -> None:
    """The per-layer hot path: a precomputed tuple index, not even a transient allocation per call."""
    import tracemalloc

    runner = ModelRunner(ServerArgs(attention_backend="torch_native"), platform="cpu")
    calls = list(ForwardMode) * 5_000  # built up front: the loop itself must not allocate
    with runner.forward_context():
        for mode in calls[:20]:  # warm up any lazily created state
            dispatch_attention_backend(mode)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            baseline, _ = tracemalloc.get_traced_memory()
            for mode in calls:
                dispatch_attention_backend(mode)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak - baseline < 64, f"dispatch allocated up to {peak - baseline} bytes over {len(calls)} calls"
