"""The backend contract: ``forward_extend`` is required, ``forward_decode`` defaults to it; speculative trees reach
only a backend that declares them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # the py312/py313 envs have no torch

import attnhost
from attnhost import (
    AttentionBackend,
    AttentionLayer,
    BackendCapabilities,
    BackendSpec,
    ForwardBatch,
    ForwardMode,
    KVPool,
    ModelRunner,
    ServerArgs,
)
from attnhost.errors import UnsupportedFeatureError
from attnhost.testing.reference import reference_attention
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class ExtendOnly(AttentionBackend):
    """Implements the one attention method a backend needs, and records which batches reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self.calls.append(forward_batch.forward_mode.name)
        if save_kv_cache:
            forward_batch.kv_pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        return reference_attention(q, layer, forward_batch).to(q.dtype)


def test_a_backend_without_forward_extend_cannot_be_instantiated() -> None:
    class DecodeOnly(AttentionBackend):
        def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
            pass

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
            return q

    with pytest.raises(TypeError, match="forward_extend"):
        DecodeOnly()  # type: ignore[abstract]


def test_forward_decode_defaults_to_forward_extend() -> None:
    torch.manual_seed(0)
    pool = KVPool(1, 64, 2, 8, max_requests=2, max_context_len=32)
    layer = AttentionLayer(0, 4, 2, 8)
    backend = ExtendOnly()
    req = pool.alloc_request()
    for mode, triple in ((ForwardMode.EXTEND, (req, 0, 5)), (ForwardMode.DECODE, (req, 5, 1))):
        batch = ForwardBatch.prepare(pool, mode, [triple])
        n = batch.num_new_tokens
        q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        assert backend.forward(q, k, v, layer, batch).shape == (n, 4, 8)
        assert backend.forward_decode(q, k, v, layer, batch, save_kv_cache=False).shape == (n, 4, 8)
    # forward() and forward_decode() both reach forward_extend, the one method implemented
    assert backend.calls == ["EXTEND", "EXTEND", "DECODE", "DECODE"]


class OwnRouter(TorchNativeAttnBackend):
    """Overrides the contract's router: vLLM and the kit would call it, SGLang would not."""

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def,misc,override]
        return super().forward(*args, **kwargs) * 2


class _RouterPlugin:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="own_router", factory=OwnRouter, description="overrides forward")]


def test_a_backend_that_overrides_the_router_is_refused_when_it_is_built() -> None:
    """SGLang calls ``forward_extend`` / ``forward_decode`` by name, vLLM and the kit call ``forward``: an
    override would pass the kit and run in vLLM, and be skipped in SGLang. One rule everywhere: refused."""
    attnhost.register_plugin(_RouterPlugin(), name="router-plugin")
    with pytest.raises(attnhost.BackendUnavailableError) as caught:
        ModelRunner(ServerArgs(attention_backend="own_router"), num_layers=1, num_kv_heads=2, head_dim=16)
    message = str(caught.value)
    assert "'own_router'" in message and "overrides AttentionBackend.forward" in message, message
    assert "implement forward_extend, forward_decode (and the MLA methods) instead" in message, message


# -- speculative trees through the runner -------------------------------------------------

# token 0 is the root; tokens 1 and 2 are its two candidates (topk 2); token 3 continues token 1
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).flatten()


class ChainOnly(TorchNativeAttnBackend):
    """torch_native's kernels without the tree_mask declaration: a backend that runs chains only."""

    capabilities = BackendCapabilities()


class _ChainPlugin:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name="chain_only", factory=ChainOnly, description="speculative chains only")]


@pytest.fixture
def chain_only() -> None:
    attnhost.register_plugin(_ChainPlugin(), name="chain-plugin")


def _verify_tree(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    request = runner.new_request()
    runner.prepare_batch(ForwardMode.EXTEND, [(request, 0, 6)])  # the prefix's K/V stays zero: fine here
    batch = runner.prepare_batch(ForwardMode.TARGET_VERIFY, [(request, 6, 4)], tree_mask=TREE)
    layer = runner.layers[0]
    q, k, v = torch.randn(4, layer.num_heads, layer.head_dim), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    with runner.forward_context() as backend:
        out = backend.forward(q, k, v, layer, batch)
    return out, q, batch


@pytest.mark.usefixtures("chain_only")
def test_a_runner_refuses_a_tree_its_backend_does_not_declare() -> None:
    runner = ModelRunner(ServerArgs(attention_backend="chain_only"), num_layers=1, num_kv_heads=2, head_dim=16)
    request = runner.new_request()
    runner.prepare_batch(ForwardMode.EXTEND, [(request, 0, 6)])
    free = runner.kv_pool.available_slots
    with pytest.raises(UnsupportedFeatureError) as caught:
        runner.prepare_batch(ForwardMode.TARGET_VERIFY, [(request, 6, 4)], tree_mask=TREE)
    assert str(caught.value) == (
        "target runner: attention backend 'chain_only' does not declare tree_mask (BackendCapabilities), so it "
        "cannot attend a speculative tree in a TARGET_VERIFY batch; use chains (speculative topk 1) or a backend "
        "that declares tree_mask"
    )
    assert runner.kv_pool.available_slots == free  # refused before any slot was taken
    runner.prepare_batch(ForwardMode.TARGET_VERIFY, [(request, 6, 4)])  # the chain is fine


@pytest.mark.usefixtures("chain_only")
@pytest.mark.parametrize(("spec_mode", "refused"), [("prefill", True), ("decode", False)])
def test_a_hybrid_target_asks_the_backend_that_serves_the_verify(spec_mode: str, refused: bool) -> None:
    """TARGET_VERIFY runs on the prefill backend, or on the decode one under speculative_attention_mode=decode."""
    args = ServerArgs(
        prefill_attention_backend="chain_only",
        decode_attention_backend="torch_native",
        speculative_attention_mode=spec_mode,  # type: ignore[arg-type]
    )
    runner = ModelRunner(args, num_layers=1, num_kv_heads=2, head_dim=16)
    assert isinstance(runner.attn_backend, attnhost.HybridAttnBackend)
    if refused:
        with pytest.raises(UnsupportedFeatureError, match="attention backend 'chain_only' does not declare"):
            _verify_tree(runner)
        return
    torch.manual_seed(0)
    out, q, batch = _verify_tree(runner)
    assert float((out.double() - reference_attention(q, runner.layers[0], batch)).abs().max()) < 1e-5


def test_a_tree_capable_runner_attends_the_tree() -> None:
    torch.manual_seed(0)
    runner = ModelRunner(ServerArgs(attention_backend="torch_native"), num_layers=1, num_kv_heads=2, head_dim=16)
    out, q, batch = _verify_tree(runner)
    assert batch.tree_mask is not None and torch.equal(batch.tree_mask, TREE)
    assert float((out.double() - reference_attention(q, runner.layers[0], batch)).abs().max()) < 1e-5


@pytest.mark.parametrize(
    ("request_spec", "message"),
    [
        ((0, 10, 8), r"spans 18 tokens, beyond req_to_token's 16 columns"),
        ((0, -2, 4), r"needs prefix_len >= 0 and extend_len >= 1, got -2, 4"),
    ],
    ids=["beyond the table", "negative prefix"],
)
def test_a_batch_whose_lengths_do_not_fit_the_request_table_is_refused(
    request_spec: tuple[int, int, int], message: str
) -> None:
    """A length beyond ``req_to_token`` would read slots never recorded (slot 0, silently); a negative one, NaN."""
    pool = KVPool(1, 64, 2, 8, max_requests=2, max_context_len=16)
    pool.alloc_request()
    loc = torch.arange(request_spec[2])
    with pytest.raises(ValueError, match=message):
        ForwardBatch.from_lists(pool, ForwardMode.EXTEND, [request_spec], loc)
