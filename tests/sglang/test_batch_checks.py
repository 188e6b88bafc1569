"""Batches that do not add up, and backends that fail: refused or named by the adapter, never a wrong number.

Each batch here starts as one of SGLang's own test-kit fixtures (real pools, real ``RadixAttention``, the
adapter built by name through SGLang's ``ATTENTION_BACKENDS``) with one thing made wrong, as a buggy
speculative worker or a hostile caller would hand it. The adapter must refuse it in one sentence naming the
backend and the entry, before any byte of the cache is written, and a backend that raises must be named with
its plugin, forward mode and layer.
"""

from __future__ import annotations

import dataclasses
import re
import unittest
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from attnhost_sglang_cpu.e2e import run_engines  # noqa: E402
from distgen import make_dist  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    build_dense_attention_fixture,
    make_dense_cases,
)
from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as verify_kit  # noqa: E402

from attnhost import AttentionBackend, BackendCapabilities, BackendFailedError, InvalidBatchError  # noqa: E402
from attnhost.engines.sglang.adapter import SGLangAdapterBackend  # noqa: E402
from attnhost.engines.sglang.multistep import SGLangMultiStepDraftBackend  # noqa: E402
from attnhost_builtin.torch_native import TorchNativeAttnBackend  # noqa: E402

BACKEND = "attnhost_torch_native"
WHERE = rf"attnhost backend 'torch_native' \(plugin 'builtin'.*\), SGLang --attention-backend '{BACKEND}'"


class _KitCase(unittest.TestCase):
    def runTest(self) -> None:  # pragma: no cover
        pass

    def skipTest(self, reason: object) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def _fixture(case: DenseAttentionCase | None = None):  # type: ignore[no-untyped-def]
    case = case or make_dense_cases(BACKEND)[0]  # an extend over cached prefixes, two requests
    with torch.no_grad():
        return build_dense_attention_fixture(_KitCase(), case, device="cpu", dtype=torch.float32)


def _verify_fixture(prefix: tuple[int, ...] = (5, 9), draft_tokens: int = 3, topk: int = 1):  # type: ignore[no-untyped-def]
    case = DenseAttentionCase(
        name="verify",
        backend=BACKEND,
        forward_mode=ForwardMode.TARGET_VERIFY,
        num_heads=4,
        num_kv_heads=2,
        page_size=1,
        prefix_lens=prefix,
        extend_lens=(draft_tokens,) * len(prefix),
    )
    fixture = _fixture(case)
    verify_kit._prepare_target_verify_batch(fixture.forward_batch, case, "cpu")
    fixture.forward_batch.spec_info = verify_kit._make_spec_verify_input(
        case, fixture.forward_batch, topk=topk, device="cpu", spec_kind="eagle"
    )
    return fixture


def _cache(fixture) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    pool = fixture.runner.token_to_kv_pool
    return [buffer.clone() for layer in range(pool.layer_num) for buffer in pool.get_kv_buffer(layer)]


def _refused(fixture, match: str) -> None:  # type: ignore[no-untyped-def]
    """The batch is refused when planned, naming the backend, and no byte of the cache changed."""
    before = _cache(fixture)
    with pytest.raises(InvalidBatchError, match=rf"{WHERE}: .*{match}.*nothing was read or written"):
        fixture.backend.init_forward_metadata(fixture.forward_batch)
    assert all(torch.equal(a, b) for a, b in zip(before, _cache(fixture), strict=True))
    layer = fixture.actual_module.attn  # and no layer runs on the refused batch
    q = torch.zeros(fixture.forward_batch.out_cache_loc.numel(), layer.tp_q_head_num * layer.qk_head_dim)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        fixture.backend.forward(q, None, None, layer, fixture.forward_batch, save_kv_cache=False)


def _set(fixture, **fields: Any) -> None:  # type: ignore[no-untyped-def]
    for name, value in fields.items():
        setattr(fixture.forward_batch, name, value)


def _with_loc(change: Callable[[torch.Tensor, int], None]) -> Callable[[Any], None]:
    def apply(fixture) -> None:  # type: ignore[no-untyped-def]
        loc = fixture.forward_batch.out_cache_loc.clone()
        change(loc, fixture.backend._num_slots)
        fixture.forward_batch.out_cache_loc = loc

    return apply


def _longer_than_the_table(fixture) -> None:  # type: ignore[no-untyped-def]
    batch, width = fixture.forward_batch, fixture.runner.req_to_token_pool.req_to_token.shape[1]
    prefix = [p + width for p in batch.extend_prefix_lens_cpu]
    _set(fixture, extend_prefix_lens_cpu=prefix, extend_prefix_lens=batch.extend_prefix_lens + width)
    _set(fixture, seq_lens=batch.seq_lens + width, seq_lens_cpu=batch.seq_lens_cpu + width)


def _negative_prefix(fixture) -> None:  # type: ignore[no-untyped-def]
    batch = fixture.forward_batch
    shift = batch.extend_prefix_lens_cpu[0] + 3
    _set(fixture, extend_prefix_lens_cpu=[batch.extend_prefix_lens_cpu[0] - shift, *batch.extend_prefix_lens_cpu[1:]])
    seq = batch.seq_lens.clone()
    seq[0] -= shift
    _set(fixture, seq_lens=seq, seq_lens_cpu=seq.cpu())


HOSTILE = {
    "slot -1": (_with_loc(lambda loc, n: loc.__setitem__(1, -1)), r"out_cache_loc\[1\] = -1 is not a slot"),
    "slot past the end": (_with_loc(lambda loc, n: loc.__setitem__(0, n)), r"out_cache_loc\[0\] = \d+ is not a slot"),
    "slot 2**31-1": (_with_loc(lambda loc, n: loc.__setitem__(2, 2**31 - 1)), r"out_cache_loc\[2\] = 2147483647"),
    "slot given twice": (_with_loc(lambda loc, n: loc.__setitem__(3, loc[1])), r"out_cache_loc\[1\] and .*\[3\] are"),
    "float slots": (lambda f: _set(f, out_cache_loc=f.forward_batch.out_cache_loc.float()), "must hold integers"),
    "request row out of the table": (
        lambda f: _set(f, req_pool_indices=f.forward_batch.req_pool_indices + 10**6),
        "not a row of the request table",
    ),
    "context beyond the table": (_longer_than_the_table, r"request 0 spans \d+ tokens, beyond the request table"),
    "negative prefix": (_negative_prefix, "request 0 has a prefix of -3"),
    "host lengths not the device's": (
        lambda f: _set(f, extend_prefix_lens_cpu=[p + 1 for p in f.forward_batch.extend_prefix_lens_cpu]),
        "host lengths .* disagree with its device seq_lens",
    ),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_batch_that_does_not_add_up_is_refused_before_anything_is_written(what: str) -> None:
    fixture = _fixture()
    change, match = HOSTILE[what]
    change(fixture)
    _refused(fixture, match)


def test_the_same_batch_unharmed_runs() -> None:
    """The fixture the hostile cases start from is a good batch: the refusals above come from the change alone."""
    fixture = _fixture()
    fixture.backend.init_forward_metadata(fixture.forward_batch)


@pytest.mark.parametrize(
    ("what", "mask", "match"),
    [
        ("additive float mask", lambda m: torch.where(m, 0.0, float("-inf")), r"1-D torch.float32 tensor.*additive"),
        ("2-D mask", lambda m: m.view(2, -1), r"2-D torch.bool tensor"),
        ("mask of another layout", lambda m: m[:-1], r"fits neither SGLang's QLEN_ONLY nor its FULL_MASK"),
    ],
)
def test_a_verify_mask_sglang_never_makes_is_refused_by_type(what: str, mask: Callable[[Any], Any], match: str) -> None:
    fixture = _verify_fixture(topk=2)
    spec = fixture.forward_batch.spec_info
    spec.custom_mask = mask(spec.custom_mask)
    _refused(fixture, match)


def test_a_verify_batch_whose_draft_token_num_disagrees_with_its_slots_is_refused() -> None:
    fixture = _verify_fixture()
    fixture.forward_batch.spec_info.draft_token_num = 4  # three slots per request were allocated
    _refused(fixture, "the batch brings 8 new tokens but 6 write slots")


def test_a_draft_round_laid_out_for_another_topk_is_refused() -> None:
    """A container built for topk 1 handed a round of topk 2 would read the wider window as its own steps."""
    case = dataclasses.replace(make_dense_cases(BACKEND)[9], extend_lens=())  # a decode batch of requests
    fixture = _fixture(case)
    assert fixture.forward_batch.forward_mode.is_decode()
    fixture.runner.is_draft_worker = True
    steps, bs = 3, fixture.forward_batch.batch_size
    container = SGLangMultiStepDraftBackend(fixture.runner, 1, steps, lambda: _adapter(fixture, TorchNativeAttnBackend))
    table = fixture.runner.req_to_token_pool.req_to_token
    fixture.forward_batch.out_cache_loc = torch.arange(bs * 2 * steps) + table.numel() // 2
    fixture.forward_batch.spec_info = SimpleNamespace(topk_p=torch.ones(bs, 2), custom_mask=None)
    with pytest.raises(InvalidBatchError, match=r"a draft round laid out for topk 2 reached .* built for topk 1"):
        container.init_forward_metadata(fixture.forward_batch)


# -- a backend that fails is named -------------------------------------------------------------------------------


class _Failing(AttentionBackend):
    """Raises where told: in planning or in a layer's forward."""

    raise_in = "forward_extend"
    error: BaseException = ValueError("kernel launch failed")

    def init_forward_metadata(self, forward_batch: Any) -> None:
        if self.raise_in == "init_forward_metadata":
            raise self.error

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        raise self.error


def _adapter(fixture, factory: type) -> SGLangAdapterBackend:  # type: ignore[no-untyped-def]
    return SGLangAdapterBackend(
        fixture.runner,
        engine_name="boom",
        attnhost_name="boom",
        origin="plugin 'boom' (distribution boom-attn 1.0)",
        factory=factory,
        capabilities=BackendCapabilities(flat_heads=True),
    )


@pytest.mark.parametrize(
    ("raise_in", "error", "where"),
    [
        ("forward_extend", ValueError("kernel launch failed"), r"forward_extend \(EXTEND batch, layer 0\): ValueError"),
        ("forward_extend", SystemExit(3), r"forward_extend \(EXTEND batch, layer 0\): SystemExit"),
        ("init_forward_metadata", RuntimeError("bad plan"), r"init_forward_metadata \(EXTEND batch\): RuntimeError"),
    ],
)
def test_a_backend_that_raises_is_named_with_its_plugin_mode_and_layer(
    raise_in: str, error: BaseException, where: str
) -> None:
    fixture = _fixture()
    failing = type("Failing", (_Failing,), {"raise_in": raise_in, "error": error})
    adapter = _adapter(fixture, failing)
    layer = fixture.actual_module.attn
    tokens = fixture.forward_batch.out_cache_loc.numel()
    with pytest.raises(BackendFailedError) as caught:
        adapter.init_forward_metadata(fixture.forward_batch)
        q = torch.zeros(tokens, layer.tp_q_head_num * layer.qk_head_dim)
        adapter.forward(q, None, None, layer, fixture.forward_batch, save_kv_cache=False)
    message = str(caught.value)
    assert re.search(
        r"^attnhost backend 'boom' \(plugin 'boom' \(distribution boom-attn 1.0\)\), SGLang --attention-backend "
        rf"'boom' failed in {where}.*report this to the maintainers of plugin 'boom'",
        message,
    ), message
    assert caught.value.__cause__ is error


BOOM = '''
"""boom-attn: a backend whose kernel raises on the first prefill (test plugin)."""
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [BackendSpec(name="boom", factory="boom_attn.kernels:Boom", platforms=("cpu",), requires=("torch",),
                        description="boom, fails in forward")]
'''

BOOM_KERNELS = '''
"""boom's kernel: plans fine, then raises in every layer's forward."""
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class Boom(TorchNativeAttnBackend):
    """boom attention (test plugin)."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        raise ValueError("illegal instruction in boom_kernel")
'''


def test_a_backend_that_raises_inside_a_real_engine_is_named(tiny_model: Any, tmp_path: Path) -> None:
    """In a real ``sglang.Engine`` the scheduler's traceback ends in attnhost's sentence naming the backend,
    its plugin and distribution, the forward mode and the layer, not in the plugin's bare exception. Its engine
    (a plugin that raises, which ends the driver) is a configuration no other test starts."""
    site = tmp_path / "site"
    make_dist(
        site,
        "boom-attn",
        "2.1",
        {"sglang.draft_attention_backends": {"boom_attn": "boom_attn"}},
        modules={"boom_attn": BOOM, "boom_attn.kernels": BOOM_KERNELS},
    )
    (probes := tmp_path / "probes").mkdir()
    runs = run_engines(tiny_model.path, tiny_model.prompts, 2, [{"backend": "boom"}], probes, path_entries=[str(site)])
    error = runs.results["boom"].get("error", "")
    expected = (
        "BackendFailedError: attnhost backend 'boom' (plugin 'boom_attn' (distribution boom-attn 2.1)), SGLang "
        "--attention-backend 'boom' failed in forward_extend (EXTEND batch, layer 0): ValueError: illegal "
        "instruction in boom_kernel; report this to the maintainers of plugin 'boom_attn'"
    )
    assert expected in error, error[-3000:]
