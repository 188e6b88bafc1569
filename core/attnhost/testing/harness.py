"""The conformance kit's harness: the set-up, runners, batches and checks every case of the kit shares.

The cases (:mod:`attnhost.testing.conformance`, and the MLA and variant cases
it inherits) read as properties of a backend; what it takes to run one layer
through the public path an engine uses, write the cache, compare against the
float64 reference and say where an output went wrong lives here, once.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NoReturn

import pytest
import torch

from attnhost.availability import check_availability
from attnhost.backend import (
    FLOAT_DTYPES,
    AttentionLayer,
    BackendCapabilities,
    capabilities_of,
    dtype_name,
)
from attnhost.dtypes import FP8_DTYPES, quantize_fp8
from attnhost.errors import printable
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.host import default_host, get_registry
from attnhost.platform import current_platform
from attnhost.registry import BackendEntry
from attnhost.runner import ModelRunner
from attnhost.server_args import ServerArgs
from attnhost.testing.diagnose import diagnose_batch
from attnhost.testing.reference import reference_attention
from attnhost.testing.watch import watch_slow

__all__ = ["ConformanceHarness", "LayerRun", "Request", "Step", "fail", "same_bits", "stored"]

Request = tuple[int, int, int]
_HANGS = "waiting for it — if it hangs, press Ctrl-C: pytest shows where it waits (--full-trace: the whole stack)"


def fail(message: str) -> NoReturn:
    """Fail with the message only: the kit's frames would hide what the author needs to read."""
    pytest.fail(message, pytrace=False)


@dataclasses.dataclass
class LayerRun:
    """One layer's forward: its inputs, its output, and the cache as it must look afterwards."""

    layer: AttentionLayer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    expected_k: torch.Tensor
    expected_v: torch.Tensor
    sinks: torch.Tensor | None = None


@dataclasses.dataclass
class Step:
    batch: ForwardBatch
    layers: list[LayerRun]


class ConformanceHarness:
    """What every case of the conformance kit runs on: the backend under test, its runners and the checks."""

    backend_name: ClassVar[str | None] = None
    """The backend under test, as registered (an alias is accepted)."""
    expect_draft: ClassVar[bool | None] = None
    """``True``/``False`` asserts the backend is/is not draft-capable; ``None`` accepts either."""
    platform: ClassVar[str | None] = None
    """Platform to resolve for (``cuda``, ``rocm``, ...); ``None`` detects it as ``attnhost`` does."""
    device: ClassVar[str] = "cpu"
    """Where the runners allocate their KV cache and the inputs live."""
    float32_atol: ClassVar[float] = 1e-5
    """Max abs error against the float64 reference for float32 inputs."""
    bfloat16_atol: ClassVar[float] = 2e-2
    """Max abs error for bfloat16 inputs (the reference sees the same bf16-rounded inputs)."""
    float16_atol: ClassVar[float] = 5e-3
    """Max abs error for float16 inputs (checked when the backend's capabilities declare float16)."""
    head_dim: ClassVar[int] = 32
    seed: ClassVar[int] = 0
    check_discovery_imports: ClassVar[bool] = True
    """Check in a subprocess that loading the plugin imports neither torch nor the factory module."""

    name: str
    entry: BackendEntry
    _generator: torch.Generator
    _pytest_config: pytest.Config
    _flat_queries = False  # test_flat_heads_layout: queries as [T, heads * head_dim]
    _saturating = 0.0  # the FP8 cases: > 0 puts K/V entries of this magnitude, beyond the cache's range, in every batch
    _fused_qkv = False  # the production shapes: q, k and v are views of one projection's output, as engines split it
    _query_scale = 1.0  # the production shapes: queries scaled up to scores of the size trained models reach
    _diagnose = True  # name the usual mistake behind a wrong output (the production shapes leave it to the small cases)

    # -- set-up ---------------------------------------------------------------------

    @pytest.fixture
    def attnhost_backend_name(self) -> str:
        """The name under test; ``pytest --attnhost-backend`` parametrizes this fixture instead."""
        if not self.backend_name:
            fail(f"{type(self).__name__}: set the class attribute backend_name = '<your backend>'")
        return self.backend_name

    @pytest.fixture(autouse=True)
    def _attnhost_conformance_setup(self, attnhost_backend_name: str, request: pytest.FixtureRequest) -> None:
        registry = get_registry()
        canonical = registry.canonical(attnhost_backend_name)
        if canonical is None:
            fail(_missing_backend_message(attnhost_backend_name))
        self.name = canonical
        self.entry = registry.entry(canonical)
        self._pytest_config = request.config
        # A private generator: the kit must not move torch's global RNG either.
        self._generator = torch.Generator().manual_seed(self.seed)
        if request.node.originalname != "test_spec_factory_importable_and_available" and self.entry.spec.implemented:
            try:  # one failure says why (test_spec_factory_importable_and_available); the rest would only repeat it
                self._load_factory()
            except Exception:
                pytest.skip(f"factory not importable: see test_spec_factory_importable_and_available[{self.name}]")

    def _load_factory(self) -> Any:
        """``spec.load()``, naming the backend on the terminal if the import runs long (see :func:`watch_slow`)."""
        doing = f"importing the factory {self._factory_text()} of backend {self.name!r} ({self.entry.label})"
        with watch_slow(self._pytest_config, doing, _HANGS):
            return self.entry.spec.load()

    def _factory_text(self) -> str:
        factory = self.entry.spec.factory
        return printable(repr(factory if isinstance(factory, str) else getattr(factory, "__qualname__", factory)))

    def _require_available(self) -> None:
        platform = current_platform(self.platform)
        availability = check_availability(self.entry, platform)
        if not availability.available:
            pytest.skip(f"backend {self.name!r} is not available on {platform}: {availability.reason}")

    def _require_draft(self) -> None:
        if not self.entry.draft:
            pytest.skip(
                f"backend {self.name!r} is target-only (its plugin does not list it in "
                "attnhost_draft_attention_backends), so there is no draft runner to test"
            )

    def _args(self) -> ServerArgs:
        return ServerArgs(
            attention_backend=self.name,
            speculative_draft_attention_backend=self.name if self.entry.draft else None,
        )

    def _runner(
        self,
        args: ServerArgs | None = None,
        *,
        is_draft: bool = False,
        num_heads: int = 8,
        num_kv_heads: int = 2,
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: torch.dtype | None = None,
        page_size: int | None = None,
        head_dim: int | None = None,
        num_layers: int = 2,
        max_requests: int = 8,
        max_context_len: int = 256,
        num_slots: int = 1024,
        table_dtype: torch.dtype = torch.int64,
        fused_kv: bool = False,
    ) -> ModelRunner:
        """A runner of the backend under test (``kv_cache_dtype``: the cache's, default ``dtype``; ``page_size``:
        the cache's pages, default a page size the backend declares, token slots where it reads any; ``head_dim``:
        default the kit's, unless the backend declares head dims without it; the rest: :class:`ModelRunner`'s)."""
        if page_size is None:
            page_size = self._page_size()
        self._require_available()
        role = "draft" if is_draft else "target"
        if head_dim is None:
            head_dim = self._head_dim()  # loads the factory: outside the build's watch, which names a slow build
        doing = (
            f"building backend {self.name!r} ({self.entry.label}) for a {role} runner: its factory "
            f"{self._factory_text()} has not returned"
        )
        try:
            with watch_slow(self._pytest_config, doing, _HANGS):
                return ModelRunner(
                    args if args is not None else self._args(),
                    is_draft=is_draft,
                    num_layers=num_layers,
                    num_heads=num_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    max_requests=max_requests,
                    max_context_len=max_context_len,
                    num_slots=num_slots,
                    dtype=dtype,
                    device=self.device,
                    platform=self.platform,
                    kv_cache_dtype=kv_cache_dtype,
                    page_size=page_size,
                    table_dtype=table_dtype,
                    fused_kv=fused_kv,
                )
        except Exception as exc:
            raise AssertionError(f"{role} runner construction: ModelRunner raised {type(exc).__name__}: {exc}") from exc

    def _capabilities(self) -> BackendCapabilities:
        try:
            return capabilities_of(self.entry.spec.load())
        except Exception:  # test_spec_factory_importable_and_available reports an unloadable factory
            return BackendCapabilities()

    def _head_dim(self) -> int:
        """``head_dim``, unless the backend declares head dims without it: then the first it declares."""
        declared = self._capabilities().head_dims
        return self.head_dim if not declared or self.head_dim in declared else declared[0]

    def _page_size(self) -> int:
        """1 (token slots), unless the backend declares page sizes without it: then the first it declares, so a
        backend that reads pages of 16 only runs every case on pages of 16, as an engine would run it."""
        declared = self._capabilities().page_sizes
        return 1 if not declared or 1 in declared else declared[0]

    def _require_dtype(self, dtype: torch.dtype) -> None:
        declared = self._capabilities().dtypes
        if dtype_name(dtype) not in declared:
            pytest.skip(
                f"backend {self.name!r} does not declare {dtype_name(dtype)} (capabilities.dtypes = {declared})"
            )

    def _declared_float_dtypes(self) -> list[torch.dtype]:
        """float32, bfloat16, float16: those the backend declares, in that order."""
        declared = self._capabilities().dtypes
        return [getattr(torch, name) for name in FLOAT_DTYPES if name in declared]

    def _speculative_runner(self, dtype: torch.dtype) -> ModelRunner:
        """The draft runner when the backend can draft (draft batches reach it there), else a target runner."""
        return self._runner(dtype=dtype, is_draft=self.entry.draft)

    def _atol(self, dtype: torch.dtype) -> float:
        return {torch.bfloat16: self.bfloat16_atol, torch.float16: self.float16_atol}.get(dtype, self.float32_atol)

    def _randn(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=self._generator).to(device=self.device, dtype=dtype)

    # -- running and checking -------------------------------------------------------

    def _forward(
        self,
        runner: ModelRunner,
        mode: ForwardMode,
        requests: Sequence[Request],
        what: str,
        *,
        check: bool = True,
        tree_mask: torch.Tensor | None = None,
        layers: Sequence[AttentionLayer] | None = None,
    ) -> Step:
        """Prepare one batch and run it through every layer (``layers``: these instead of the runner's, e.g. with
        attention variants); ``check`` compares each output with the reference.

        Tests of other properties pass ``check=False``, so a numerical error
        fails the numerics tests only and every failure names one property.
        """
        batch = self._prepare(runner, mode, requests, what, tree_mask)
        run = runner.layers if layers is None else layers
        return Step(batch, [self._run_layer(runner, batch, layer, what, check=check) for layer in run])

    def _extend_twice_then_decode(
        self, runner: ModelRunner, first: tuple[int, int], second: tuple[int, int], label: str
    ) -> None:
        """Two requests: a prefill of ``first`` tokens, an extend of ``second`` over that prefix, one decode step."""
        r0, r1 = runner.new_request(), runner.new_request()
        (a0, a1), (b0, b1) = first, second
        self._forward(runner, ForwardMode.EXTEND, [(r0, 0, a0), (r1, 0, a1)], f"{label} extend")
        self._forward(runner, ForwardMode.EXTEND, [(r0, a0, b0), (r1, a1, b1)], f"{label} extend with cached prefix")
        self._forward(runner, ForwardMode.DECODE, [(r0, a0 + b0, 1), (r1, a1 + b1, 1)], f"{label} decode")

    @staticmethod
    def _prepare(
        runner: ModelRunner,
        mode: ForwardMode,
        requests: Sequence[Request],
        what: str,
        tree_mask: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """``runner.prepare_batch``, which calls the backend's ``init_forward_metadata`` once for the batch."""
        try:
            return runner.prepare_batch(mode, requests, tree_mask)
        except Exception as exc:
            raise AssertionError(
                f"{what}: init_forward_metadata ({mode.name}) raised {type(exc).__name__}: {exc}"
            ) from exc

    def _run_layer(
        self, runner: ModelRunner, batch: ForwardBatch, layer: AttentionLayer, what: str, *, check: bool = True
    ) -> LayerRun:
        pool = runner.kv_pool
        n = batch.num_new_tokens
        q, k, v = self._new_qkv(n, layer, runner.dtype)
        if self._saturating:  # every 3rd token, every 5th entry: both signs, beyond finfo.max * scale
            sign = torch.where(self._randn(n, 1, 1, dtype=runner.dtype) > 0, 1.0, -1.0).to(runner.dtype)
            k[::3, :, ::5] = (sign[::3] * self._saturating).expand_as(k[::3, :, ::5])
            v[1::3, :, ::5] = (sign[1::3] * self._saturating).expand_as(v[1::3, :, ::5])
        expected_k = pool.k_buffer(layer.layer_id).clone()
        expected_v = pool.v_buffer(layer.layer_id).clone()
        expected_k[batch.out_cache_loc] = stored(k, layer.k_scale, pool.dtype)
        expected_v[batch.out_cache_loc] = stored(v, layer.v_scale, pool.dtype)
        # sink logits of either sign and large enough to take a visible share of the softmax (docs/variants.md)
        sinks = self._randn(layer.num_heads, dtype=runner.dtype) * 1.5 + 1.0 if layer.has_sinks else None
        if self._flat_queries:
            flat_out = self._call(runner, q.flatten(1), k, v, layer, batch, what, sinks=sinks)
            out = self._from_flat(flat_out, layer, n, what)
        else:
            out = self._call(runner, q, k, v, layer, batch, what, sinks=sinks)
        run = LayerRun(layer, q, k, v, out, expected_k, expected_v, sinks)
        if check:
            self._check_output(what, run, batch)
        return run

    def _new_qkv(
        self, n: int, layer: AttentionLayer, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random ``q``, ``k``, ``v`` for ``n`` new tokens: three tensors, or (``_fused_qkv``) strided views of one
        ``[n, (heads + 2 * kv_heads) * head_dim]`` projection output, which is what engines pass."""
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        if not self._fused_qkv:
            q = self._randn(n, heads, dim, dtype=dtype)
            if self._query_scale != 1.0:
                q = q * self._query_scale
            return q, self._randn(n, kv_heads, dim, dtype=dtype), self._randn(n, kv_heads, dim, dtype=dtype)
        qkv = self._randn(n, (heads + 2 * kv_heads) * dim, dtype=dtype)
        q_width, kv_width = heads * dim, kv_heads * dim
        qkv[:, :q_width] *= self._query_scale
        q = qkv[:, :q_width].view(n, heads, dim)
        k = qkv[:, q_width : q_width + kv_width].view(n, kv_heads, dim)
        v = qkv[:, q_width + kv_width :].view(n, kv_heads, dim)
        return q, k, v

    @staticmethod
    def _from_flat(out: torch.Tensor, layer: AttentionLayer, tokens: int, what: str) -> torch.Tensor:
        expected = (tokens, layer.num_heads * layer.head_dim)
        if tuple(out.shape) != expected:
            fail(
                f"{what}: output shape {tuple(out.shape)} for a [tokens, num_heads * head_dim] query, expected "
                f"{expected}: a backend that declares flat_heads answers in the layout it was asked in"
            )
        return out.reshape(tokens, layer.num_heads, layer.head_dim)

    def _call(
        self,
        runner: ModelRunner,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        what: str,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        try:
            with torch.no_grad(), runner.forward_context() as backend:
                if sinks is None:  # a backend that does not declare sinks never gets the keyword
                    out = backend.forward(q, k, v, layer, batch, save_kv_cache)
                else:
                    out = backend.forward(q, k, v, layer, batch, save_kv_cache, sinks=sinks)
        except Exception as exc:
            raise AssertionError(
                f"{what}: forward ({batch.forward_mode.name}, layer {layer.layer_id}) raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(out, torch.Tensor):
            fail(f"{what}: forward returned {type(out).__name__}, not a torch.Tensor")
        return out

    def _check_output(
        self,
        what: str,
        run: LayerRun,
        batch: ForwardBatch,
        *,
        k_buffer: torch.Tensor | None = None,
        v_buffer: torch.Tensor | None = None,
    ) -> None:
        problem = self._output_error(run, batch, k_buffer=k_buffer, v_buffer=v_buffer)
        if problem is not None:
            fail(f"{what}: {problem}")

    def _output_error(
        self,
        run: LayerRun,
        batch: ForwardBatch,
        *,
        k_buffer: torch.Tensor | None = None,
        v_buffer: torch.Tensor | None = None,
    ) -> str | None:
        """What is wrong with the layer's output compared with the reference over these buffers, if anything."""
        layer, out, q = run.layer, run.out, run.q
        expected_shape = (batch.num_new_tokens, layer.num_heads, layer.head_dim)
        if tuple(out.shape) != expected_shape:
            return (
                f"output shape {tuple(out.shape)}, expected {expected_shape} "
                f"([tokens, num_heads, head_dim], layer {layer.layer_id})"
            )
        if out.dtype != q.dtype:
            return f"output dtype {dtype_name(out.dtype)}, expected the query's {dtype_name(q.dtype)}"
        ref = reference_attention(
            q,
            layer,
            batch,
            k_buffer=run.expected_k if k_buffer is None else k_buffer,
            v_buffer=run.expected_v if v_buffer is None else v_buffer,
            sinks=run.sinks,
        )
        got = out.detach().to("cpu", torch.float64)
        atol = self._atol(q.dtype)
        diff = (got - ref).abs()
        finite = torch.isfinite(got)
        if not bool(finite.all()):
            index = int((~finite).flatten().nonzero()[0])
            return f"output is not finite ({self._where(index, layer, batch, q.dtype)})"
        error = float(diff.max()) if diff.numel() else 0.0
        if not error <= atol:  # a NaN error fails too: a non-finite reference must never pass as agreement
            index = int(diff.flatten().argmax())
            k_read = run.expected_k if k_buffer is None else k_buffer
            v_read = run.expected_v if v_buffer is None else v_buffer
            why = (
                diagnose_batch(out, q, layer, batch, atol, k_buffer=k_read, v_buffer=v_read, sinks=run.sinks)
                if self._diagnose
                else None
            )
            where = self._where(index, layer, batch, q.dtype)
            return f"max abs error {error:.1e} exceeds {atol:.0e} ({where})" + (f"; {why}" if why else "")
        return None

    @staticmethod
    def _where(flat_index: int, layer: AttentionLayer, batch: ForwardBatch, dtype: torch.dtype) -> str:
        """Turn a flat output index into "request 1, token 4 of 11, head 2" for the failure message."""
        token, rest = divmod(flat_index, layer.num_heads * layer.head_dim)
        head = rest // layer.head_dim
        request = bisect.bisect_right(batch.extend_start_loc_cpu, token) - 1
        within = token - batch.extend_start_loc_cpu[request]
        return (
            f"{dtype_name(dtype)}, {layer.num_heads} heads / {layer.num_kv_heads} KV heads, layer {layer.layer_id}, "
            f"request {request}, token {within} of {batch.extend_seq_lens_cpu[request]}, head {head}"
        )

    def _speculative_dtypes(self) -> list[tuple[torch.dtype, bool]]:
        """The declared float dtypes, each with whether its case runs in full (the first one) or its main batch."""
        return [(dtype, i == 0) for i, dtype in enumerate(self._declared_float_dtypes())]

    def _speculative_prefill(self, runner: ModelRunner, label: str) -> tuple[list[int], int]:
        """Three requests prefilled with 13, 1 and 30 tokens, and a fourth whose 17-token prefix is scattered."""
        r = [runner.new_request() for _ in range(3)]
        self._forward(runner, ForwardMode.EXTEND, [(r[0], 0, 13), (r[1], 0, 1), (r[2], 0, 30)], f"{label}: prefill")
        return r, self._fragmented_prefix(runner, 17)

    def _fragmented_prefix(self, runner: ModelRunner, prefix_len: int) -> int:
        """A request whose cached prefix sits in descending, non-contiguous slots (pages, with pages), written by the
        caller."""
        pool = runner.kv_pool
        request = runner.new_request()
        pages = -(-prefix_len // pool.page_size)
        slots = pool.page_slots(pool.alloc_pages(pages).flip(0))[:prefix_len]  # in pages: offsets stay in order
        pool.req_to_token[request, :prefix_len] = slots
        for layer in runner.layers:
            pool.set_kv(
                layer.layer_id,
                slots,
                self._randn(prefix_len, layer.num_kv_heads, layer.head_dim, dtype=pool.dtype),
                self._randn(prefix_len, layer.num_kv_heads, layer.head_dim, dtype=pool.dtype),
            )
        return request


def stored(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of ``dtype`` must hold after writing ``x``: the quantising write of an FP8 one
    (docs/kv-cache.md), else ``x`` cast."""
    return quantize_fp8(x, scale, dtype) if dtype in FP8_DTYPES else x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` for any cache dtype: FP8 has no equality kernel, so one-byte tensors compare as bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _missing_backend_message(name: str) -> str:
    """Why ``name`` is not registered, naming the plugin that failed to load when one did (the registry's rule for
    which failed plugin a missing name points at, so the kit and the CLI blame the same one)."""
    registry = get_registry()
    failed = [p for p in default_host().plugins() if p.status.value == "failed"]
    unknown = registry.unknown_message(name)
    if not failed:
        return f"spec: {unknown}; is the plugin installed (`attnhost list`) and did it load (`attnhost plugins`)?"
    likely = registry.failed_plugins_for(name)
    causes = "; ".join(f"{p.origin} failed to load: {p.error}" for p in likely or failed)
    if likely:
        return (
            f"spec: backend {name!r} is not registered because {causes}; fix the plugin, then check `attnhost plugins`"
        )
    return f"spec: {unknown}; perhaps because {causes}; fix the plugin, then check `attnhost plugins`"
