"""MLA (multi-head latent attention) in the contract: its facts and forms, the latent cache, torch_native's two
forms against the float64 reference, refusals by name, and the conformance kit catching a backend that reads the
wrong slice of the latent as V."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import torch  # noqa: E402

import attnhost  # noqa: E402
from attnhost import (  # noqa: E402
    AttentionBackend,
    AttentionLayer,
    BackendCapabilities,
    BackendSpec,
    ForwardBatch,
    ForwardMode,
    ModelRunner,
    ServerArgs,
    UnsupportedFeatureError,
)
from attnhost.host import get_registry  # noqa: E402
from attnhost.mla import MLAConfig, MLAForm  # noqa: E402
from attnhost.mla_pool import MLAKVPool  # noqa: E402
from attnhost.testing import BackendConformance  # noqa: E402
from attnhost.testing.mla_reference import reference_mla_absorbed, reference_mla_mha  # noqa: E402
from attnhost_builtin.torch_native import TorchNativeAttnBackend  # noqa: E402

CONFIG = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)
TOL = 1e-5


def mla_runner(backend: str = "torch_native", config: MLAConfig = CONFIG, heads: int = 8) -> ModelRunner:
    return ModelRunner(
        ServerArgs(attention_backend=backend),
        num_layers=2,
        num_heads=heads,
        mla=config,
        max_requests=8,
        max_context_len=128,
        num_slots=512,
    )


def absorbed_step(
    runner: ModelRunner, mode: ForwardMode, requests: list[tuple[int, int, int]], *, split: bool = False
) -> float:
    """One batch through every absorbed layer; the largest error against the reference (the cache checked too)."""
    batch = runner.prepare_batch(mode, requests)
    pool, worst = runner.kv_pool, 0.0
    for layer in runner.layers:
        n, rank = batch.num_new_tokens, CONFIG.kv_lora_rank
        q, k = torch.randn(n, layer.num_heads, layer.head_dim), torch.randn(n, 1, layer.head_dim)
        expected = pool.k_buffer(layer.layer_id).clone()
        expected[batch.out_cache_loc] = k
        with runner.forward_context() as backend:
            if split:
                out = backend.forward(
                    q[..., :rank],
                    k[..., :rank],
                    k[..., :rank],
                    layer,
                    batch,
                    q_rope=q[..., rank:],
                    k_rope=k[..., rank:],
                )
            else:
                out = backend.forward(q, k, k[..., :rank], layer, batch)
        assert torch.equal(pool.k_buffer(layer.layer_id), expected)
        assert out.shape == (n, layer.num_heads, rank)
        worst = max(worst, float((out.double() - reference_mla_absorbed(q, layer, batch, expected)).abs().max()))
    return worst


# -- the contract -------------------------------------------------------------------------


def test_the_two_forms_have_sglangs_shapes_and_the_models_scaling() -> None:
    absorbed, mha = (
        AttentionLayer.for_mla(CONFIG, MLAForm.ABSORBED, 3, 8),
        AttentionLayer.for_mla(CONFIG, MLAForm.MHA, 3, 8),
    )
    assert (absorbed.num_kv_heads, absorbed.head_dim, absorbed.v_head_dim) == (1, 48, 32)
    assert (mha.num_kv_heads, mha.head_dim, mha.v_head_dim) == (8, 32, 24)
    # absorbing W_UK into the queries changes no score: both forms keep 1/sqrt(qk_nope + qk_rope)
    assert absorbed.scaling == mha.scaling == pytest.approx(32**-0.5)
    assert AttentionLayer(0, 8, 2, 64).v_head_dim == 64  # dense layers: V as wide as QK


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: AttentionLayer(0, 8, 8, 32, v_head_dim=24), "only MLA layers"),
        (lambda: AttentionLayer(0, 8, 8, 32, mla=CONFIG), "needs both mla"),
        (lambda: AttentionLayer(0, 8, 2, 48, v_head_dim=32, mla=CONFIG, mla_form=MLAForm.ABSORBED), "got (2, 48, 32)"),
        (lambda: MLAConfig(kv_lora_rank=0, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24), "kv_lora_rank"),
        (lambda: MLAConfig(kv_lora_rank=32, qk_rope_head_dim=-1, qk_nope_head_dim=16, v_head_dim=24), ">= 0"),
        (lambda: BackendCapabilities(mla="yes"), "mla must be True or False"),  # type: ignore[arg-type]
    ],
)
def test_inconsistent_mla_facts_are_refused_naming_them(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()  # type: ignore[operator]


def test_capabilities_refuse_mla_unless_declared() -> None:
    assert "MLA" in (BackendCapabilities().refusal(dtype="float32", head_dim=48, mla=True) or "")
    assert BackendCapabilities(mla=True).refusal(dtype="float32", head_dim=48, mla=True) is None
    # head_dims constrains dense layers: an MLA layer's dims are its latent's
    assert BackendCapabilities(mla=True, head_dims=(128,)).refusal(dtype="float32", head_dim=48, mla=True) is None


def test_the_latent_pool_is_sglangs_one_row_per_token() -> None:
    pool = MLAKVPool(2, 16, CONFIG, max_requests=2, max_context_len=8)
    k, v = pool.k_buffer(1), pool.v_buffer(1)
    assert k.shape == (16, 1, 48) and v.shape == (16, 1, 32)
    assert v.data_ptr() == k.data_ptr() and v.stride() == k.stride()  # V is a view of K's first kv_lora_rank
    rows = torch.randn(3, 1, 48)
    pool.set_kv(1, torch.tensor([4, 0, 9]), rows, None)
    assert torch.equal(k[[4, 0, 9]], rows) and torch.equal(v[[4, 0, 9]], rows[..., :32])
    assert not pool.k_buffer(0).any()
    with pytest.raises(ValueError, match=r"latent rows of shape \(3, 1, 48\).*got \(3, 1, 32\)"):
        pool.set_kv(1, torch.tensor([4, 0, 9]), rows[..., :32], None)


# -- torch_native, both forms ---------------------------------------------------------------


def test_torch_native_absorbed_form_in_every_mode() -> None:
    torch.manual_seed(0)
    runner = mla_runner()
    r = [runner.new_request() for _ in range(3)]
    assert absorbed_step(runner, ForwardMode.EXTEND, [(r[0], 0, 13), (r[1], 0, 1), (r[2], 0, 30)]) < TOL
    assert absorbed_step(runner, ForwardMode.EXTEND, [(r[0], 13, 5), (r[1], 1, 3)], split=True) < TOL
    assert absorbed_step(runner, ForwardMode.DECODE, [(r[0], 18, 1), (r[1], 4, 1), (r[2], 30, 1)]) < TOL
    assert absorbed_step(runner, ForwardMode.DECODE, [(r[2], 31, 1)], split=True) < TOL
    assert absorbed_step(runner, ForwardMode.MIXED, [(r[0], 19, 1), (r[1], 5, 4)]) < TOL
    assert absorbed_step(runner, ForwardMode.TARGET_VERIFY, [(r[0], 20, 4), (r[2], 32, 4)]) < TOL


def test_torch_native_mha_form_attends_over_its_arguments_and_leaves_the_cache() -> None:
    torch.manual_seed(1)
    runner = mla_runner()
    batch = runner.prepare_batch(ForwardMode.EXTEND, [(runner.new_request(), 0, 9), (runner.new_request(), 0, 4)])
    for layer in runner.mha_layers:
        q, k = torch.randn(13, 8, layer.head_dim), torch.randn(13, 8, layer.head_dim)
        v = torch.randn(13, 8, layer.v_head_dim)
        before = runner.kv_pool.k_buffer(layer.layer_id).clone()
        with runner.forward_context() as backend:
            out = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
            flat = backend.forward(q.flatten(1), k, v, layer, batch, save_kv_cache=False)
        assert torch.equal(runner.kv_pool.k_buffer(layer.layer_id), before)
        assert out.shape == (13, 8, 24) and flat.shape == (13, 8 * 24)
        assert float((out.double() - reference_mla_mha(q, k, v, layer, batch)).abs().max()) < TOL
        assert torch.equal(flat.view(13, 8, 24), out)


def test_the_mha_form_refuses_what_it_cannot_do() -> None:
    runner = mla_runner()
    r = runner.new_request()
    runner.prepare_batch(ForwardMode.EXTEND, [(r, 0, 5)])
    batch = runner.prepare_batch(ForwardMode.EXTEND, [(r, 5, 3)])
    layer = runner.mha_layers[0]
    q, v = torch.randn(3, 8, layer.head_dim), torch.randn(3, 8, layer.v_head_dim)
    with runner.forward_context() as backend:
        with pytest.raises(ValueError, match="save_kv_cache=False, since the caller writes the latent"):
            backend.forward(q, q, v, layer, batch)
        with pytest.raises(ValueError, match="request 0 of this EXTEND batch has a cached prefix of 5 tokens"):
            backend.forward(q, q, v, layer, batch, save_kv_cache=False)
        with pytest.raises(ValueError, match="dense layer: it takes k and v and no q_rope"):
            backend.forward(q, q, v, AttentionLayer(0, 8, 8, layer.head_dim), batch, q_rope=q)


# -- refusals by name -------------------------------------------------------------------------


class DenseOnly(TorchNativeAttnBackend):
    """torch_native's kernels without the MLA declaration."""

    capabilities = BackendCapabilities(flat_heads=True, tree_mask=True)


class WrongValueSlice(TorchNativeAttnBackend):
    """Absorbed MLA that takes the latent's *last* kv_lora_rank columns as V (a slip a port can make)."""

    def forward_mla_mqa(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        q_rope: torch.Tensor | None = None,
        k_rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        mla = layer.mla
        assert mla is not None
        pool, rank = forward_batch.kv_pool, mla.kv_lora_rank
        if save_kv_cache:
            assert k is not None
            row = k if k_rope is None else torch.cat([k, k_rope], -1)
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, row, row[..., :rank])
        if q_rope is not None:
            q = torch.cat([q.reshape(-1, layer.num_heads, rank), q_rope.reshape(-1, layer.num_heads, -1)], -1)
        q = q.view(-1, layer.num_heads, mla.latent_dim)
        outs = []
        for i in range(forward_batch.batch_size):
            start, n = forward_batch.extend_start_loc_cpu[i], forward_batch.extend_seq_lens_cpu[i]
            seq, prefix = forward_batch.seq_lens_cpu[i], forward_batch.prefix_lens_cpu[i]
            rows = pool.k_buffer(layer.layer_id)[pool.req_to_token[int(forward_batch.req_pool_indices[i]), :seq], 0]
            scores = torch.einsum("thd,sd->hts", q[start : start + n].to(rows.dtype), rows) * layer.scaling
            visible = torch.arange(seq).unsqueeze(0) <= torch.arange(n).unsqueeze(1) + prefix
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hts,sd->thd", weights, rows[:, -rank:]).to(q.dtype))
        return torch.cat(outs)


class _Plugin:
    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(name="dense_only", factory=DenseOnly, description="dense attention only"),
            BackendSpec(name="wrong_v_slice", factory=WrongValueSlice, description="reads the wrong V slice"),
        ]


@pytest.fixture
def plugin() -> None:
    attnhost.register_plugin(_Plugin(), name="mla-test-plugin")


@pytest.mark.usefixtures("plugin")
def test_an_mla_model_on_a_backend_that_does_not_declare_it_is_refused_when_the_runner_is_built() -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        mla_runner("dense_only")
    message = str(info.value)
    assert "'dense_only'" in message and "MLA model (multi-head latent attention" in message
    assert "does not declare BackendCapabilities.mla" in message and "\n" not in message


def test_the_base_contract_refuses_mla_by_name() -> None:
    class Plain(AttentionBackend):
        def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
            pass

        def forward_extend(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("not reached")

    backend = Plain()
    backend.prefill_attention_backend_str = "plain"
    with pytest.raises(UnsupportedFeatureError, match="'plain' does not implement MLA"):
        backend.forward_mla_mqa(
            torch.zeros(1), None, None, AttentionLayer.for_mla(CONFIG, MLAForm.ABSORBED, 0, 2), None
        )  # type: ignore[arg-type]


# -- the conformance kit ----------------------------------------------------------------------


class _Kit(BackendConformance):
    pass


def _kit(name: str) -> _Kit:
    """The kit's MLA checks as its pytest set-up would prepare them, against backend ``name``."""
    kit = _Kit()
    kit.name = name
    kit.entry = get_registry().entry(name)
    kit._generator = torch.Generator().manual_seed(0)
    return kit


@pytest.mark.usefixtures("plugin")
def test_the_kit_fails_a_backend_that_reads_the_wrong_slice_of_the_latent_as_v() -> None:
    kit = _kit("wrong_v_slice")
    with pytest.raises(pytest.fail.Exception) as info:
        kit.test_mla_decode()
    message = str(info.value)
    assert message.startswith("MLA decode: the prefill") or message.startswith("MLA decode")
    assert "(float32, latent 32 + rope 16)" in message and "max abs error" in message and "exceeds 1e-05" in message


@pytest.mark.usefixtures("plugin")
def test_the_kit_passes_torch_native_and_checks_the_refusal_of_a_dense_only_backend() -> None:
    kit = _kit("torch_native")
    kit.test_mla_mha_form()
    kit.test_mla_extend()
    _kit("dense_only").test_mla_refused_unless_declared()
    with pytest.raises(pytest.skip.Exception, match="does not declare mla"):
        _kit("dense_only").test_mla_decode()
