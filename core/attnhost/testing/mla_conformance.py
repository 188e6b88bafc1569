"""The conformance kit's MLA checks (multi-head latent attention, docs/mla.md), mixed into ``BackendConformance``.

For a backend that declares ``capabilities.mla``, every case runs in every float dtype it declares and for each of
``mla_configs`` (two latent shapes by default), through an MLA ``ModelRunner`` (its cache an ``MLAKVPool``, laid
out as SGLang's ``MLATokenToKVPool``), and is compared with :mod:`attnhost.testing.mla_reference` (float64):

* the absorbed form in every forward mode the dense kit covers (extend with and without a cached prefix, a
  prefix in scattered slots, decode, mixed, target verify as a chain and, where declared, as a tree, draft
  extend, draft decode over branch rows), its rope part joined to the query and passed apart (``q_rope`` /
  ``k_rope``), with ``save_kv_cache=False`` and no ``k``/``v`` as SGLang's own MLA kit calls it, and flat
  queries where ``flat_heads`` is declared; after each layer the cache must hold exactly the new latent rows;
* the MHA form over a prefill, with the latent written by the caller and left alone by the backend.

A backend that does not declare MLA is checked only for being refused by name when an MLA model asks for it.
A failure names the case and the error, e.g. ``MLA decode (float32, latent 32 + rope 16): max abs error 1.2e+00
exceeds 1e-05 (8 heads, layer 0, request 1, token 0 of 1, head 3)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import pytest
import torch

from attnhost.backend import AttentionLayer, dtype_name
from attnhost.errors import UnsupportedFeatureError
from attnhost.forward_batch import ForwardBatch
from attnhost.forward_mode import ForwardMode
from attnhost.mla import MLAConfig
from attnhost.runner import ModelRunner
from attnhost.testing.cases import SPECULATIVE_TREES
from attnhost.testing.harness import ConformanceHarness, Request, fail
from attnhost.testing.mla_reference import reference_mla_absorbed, reference_mla_mha
from attnhost.testing.reference import tree_mask

if TYPE_CHECKING:
    pass

__all__ = ["MLA_PRODUCTION_SHAPE", "MLAConformance", "MLAProductionShape"]

_CHAIN = 4


@dataclasses.dataclass(frozen=True)
class MLAProductionShape:
    """A served MLA model's attention at its real sizes, and the requests the production case runs (as
    :class:`attnhost.testing.cases.ProductionShape`: cached contexts written by the kit, then new tokens)."""

    model: str
    config: MLAConfig
    num_heads: int
    num_layers: int
    contexts: tuple[int, ...]
    extend: tuple[int, ...]


MLA_PRODUCTION_SHAPE = MLAProductionShape(
    model="DeepSeek V3 on 8 ranks",
    config=MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    num_heads=16,
    num_layers=3,
    contexts=(1800, 1, 95, 0, 400, 33, 250, 7, 0, 64, 600, 12),
    extend=(2, 40, 130, 9, 0, 1, 0, 5, 70, 0, 3, 17),
)


class MLAConformance(ConformanceHarness):
    """The MLA cases of the conformance kit; ``BackendConformance`` inherits them (override ``mla_configs`` to
    test the latent shapes a kernel supports, e.g. DeepSeek V3's ``MLAConfig(512, 64, 128, 128)``)."""

    mla_configs: ClassVar[tuple[MLAConfig, ...]] = (
        MLAConfig(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24),
        MLAConfig(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32),
    )
    mla_num_heads: ClassVar[int] = 8

    # -- set-up ---------------------------------------------------------------------

    def _require_mla(self) -> None:
        if not self._capabilities().mla:
            pytest.skip(
                f"backend {self.name!r} does not declare mla (capabilities.mla = False): MLA models are refused"
            )

    def _mla_cases(self) -> list[tuple[torch.dtype, MLAConfig, str]]:
        """Every declared float dtype with every latent shape, and the label that names the pair."""
        return [
            (dtype, config, f"{dtype_name(dtype)}, latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim}")
            for dtype in self._declared_float_dtypes()
            for config in self.mla_configs
        ]

    def _mla_runner(
        self,
        config: MLAConfig,
        dtype: torch.dtype,
        *,
        is_draft: bool = False,
        num_heads: int | None = None,
        num_layers: int = 2,
        max_requests: int = 12,
        max_context_len: int = 256,
        num_slots: int = 2048,
        table_dtype: torch.dtype = torch.int64,
    ) -> ModelRunner:
        self._require_available()
        return ModelRunner(
            self._args(),
            is_draft=is_draft,
            num_layers=num_layers,
            num_heads=self.mla_num_heads if num_heads is None else num_heads,
            mla=config,
            max_requests=max_requests,
            max_context_len=max_context_len,
            num_slots=num_slots,
            dtype=dtype,
            device=self.device,
            platform=self.platform,
            page_size=self._page_size(),
            table_dtype=table_dtype,
        )

    # -- running and checking -------------------------------------------------------

    def _mla_step(
        self,
        runner: ModelRunner,
        mode: ForwardMode,
        requests: Sequence[Request],
        what: str,
        *,
        split: bool = False,
        flat: bool = False,
        from_cache: bool = False,
        tree: torch.Tensor | None = None,
    ) -> None:
        """One batch in the absorbed form through every layer, each output and the cache checked.

        ``split``: the rope parts passed apart; ``flat``: queries as ``[T, heads * latent_dim]``; ``from_cache``:
        the kit writes the latent rows and calls with ``k = v = None, save_kv_cache=False`` (SGLang's MLA kit)."""
        try:
            batch = runner.prepare_batch(mode, requests, tree)
        except Exception as exc:
            raise AssertionError(
                f"{what}: init_forward_metadata ({mode.name}) raised {type(exc).__name__}: {exc}"
            ) from exc
        pool = runner.kv_pool
        for layer in runner.layers:
            mla = layer.mla
            assert mla is not None
            n, rank, width = batch.num_new_tokens, mla.kv_lora_rank, mla.latent_dim
            q = self._randn(n, layer.num_heads, width, dtype=runner.dtype)
            k = self._randn(n, 1, width, dtype=runner.dtype)
            expected = pool.k_buffer(layer.layer_id).clone()
            expected[batch.out_cache_loc] = k.to(pool.dtype)
            if from_cache:
                pool.set_kv(layer.layer_id, batch.out_cache_loc, k, k[..., :rank])
            args: tuple[torch.Tensor | None, ...] = (q, k, k[..., :rank])
            extra: dict[str, torch.Tensor] = {}
            if split:
                args, extra = (q[..., :rank], k[..., :rank], k[..., :rank]), {"q_rope": q[..., rank:]}
                extra["k_rope"] = k[..., rank:]
            if from_cache:
                args = (args[0], None, None)
                extra.pop("k_rope", None)
            query = args[0]
            assert query is not None
            if flat:
                query = query.flatten(1)
            try:
                with torch.no_grad(), runner.forward_context() as backend:
                    out = backend.forward(query, args[1], args[2], layer, batch, not from_cache, **extra)
            except Exception as exc:
                raise AssertionError(
                    f"{what}: forward ({mode.name}, MLA layer {layer.layer_id}) raised {type(exc).__name__}: {exc}"
                ) from exc
            self._check_latent(what, pool.k_buffer(layer.layer_id), expected, batch, layer)
            shape = (n, layer.num_heads * rank) if flat else (n, layer.num_heads, rank)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                fail(f"{what}: output {got}, expected {shape} (the values are kv_lora_rank = {rank} wide)")
            if out.dtype != q.dtype:
                fail(f"{what}: output dtype {dtype_name(out.dtype)}, expected the query's {dtype_name(q.dtype)}")
            ref = reference_mla_absorbed(q, layer, batch, expected)
            self._compare(what, out.reshape(n, layer.num_heads, rank), ref, layer, batch)

    def _check_latent(
        self, what: str, latent: torch.Tensor, expected: torch.Tensor, batch: ForwardBatch, layer: AttentionLayer
    ) -> None:
        if torch.equal(latent, expected):
            return
        slot = int((latent != expected).flatten(1).any(dim=1).nonzero()[0])
        change = float((latent[slot].double() - expected[slot].double()).abs().max())
        written = bool((batch.out_cache_loc == slot).any())
        fail(
            f"{what}: MLA layer {layer.layer_id}'s latent row at slot {slot} "
            + (
                f"is not the new token's row (max abs diff {change:.1e}); write k (joined with k_rope) whole, with "
                "kv_pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, row, row[..., :kv_lora_rank])"
                if written
                else f"changed although it is not in out_cache_loc (max abs change {change:.1e})"
            )
        )

    def _compare(
        self, what: str, out: torch.Tensor, ref: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> None:
        got = out.detach().to("cpu", torch.float64)
        finite = torch.isfinite(got)
        diff = (got - ref).abs().masked_fill(~finite, float("inf"))
        error = float(diff.max()) if diff.numel() else 0.0
        atol = self._atol(out.dtype)
        if error <= atol:
            return
        token, rest = divmod(int(diff.flatten().argmax()), layer.num_heads * ref.shape[-1])
        request = max(i for i, start in enumerate(batch.extend_start_loc_cpu) if start <= token)
        within = token - batch.extend_start_loc_cpu[request]
        fail(
            f"{what}: max abs error {error:.1e} exceeds {atol:.0e} ({layer.num_heads} heads, layer "
            f"{layer.layer_id}, request {request}, token {within} of {batch.extend_seq_lens_cpu[request]}, head "
            f"{rest // ref.shape[-1]})"
        )

    def _mla_prefill(self, runner: ModelRunner, label: str) -> tuple[list[int], int]:
        """Three requests prefilled with 13, 1 and 30 tokens, and a fourth whose 17-token prefix sits in
        descending, scattered slots."""
        r = [runner.new_request() for _ in range(3)]
        self._mla_step(runner, ForwardMode.EXTEND, [(r[0], 0, 13), (r[1], 0, 1), (r[2], 0, 30)], f"{label}: prefill")
        pool = runner.kv_pool
        scattered = runner.new_request()
        slots = pool.alloc_slots(17).flip(0)
        pool.req_to_token[scattered, :17] = slots
        for layer in runner.layers:
            rows = self._randn(17, 1, layer.head_dim, dtype=pool.dtype)
            pool.set_kv(layer.layer_id, slots, rows, rows[..., : layer.v_head_dim])
        return r, scattered

    # -- the cases --------------------------------------------------------------------

    def test_mla_refused_unless_declared(self) -> None:
        """A backend without ``capabilities.mla`` is refused by name when an MLA model's runner is built."""
        if self._capabilities().mla:
            pytest.skip(f"backend {self.name!r} declares mla")
        try:
            self._mla_runner(self.mla_configs[0], torch.float32)
        except UnsupportedFeatureError as exc:
            if self.name not in str(exc) or "MLA" not in str(exc):
                fail(f"MLA refusal: the message names neither the backend nor MLA: {exc}")
            return
        fail(f"MLA refusal: an MLA runner was built on {self.name!r}, which does not declare mla")

    def test_mla_extend(self) -> None:
        """The absorbed form over prefills and extends with cached (contiguous and scattered) prefixes."""
        self._require_mla()
        for dtype, config, label in self._mla_cases():
            runner = self._mla_runner(config, dtype)
            r, scattered = self._mla_prefill(runner, f"MLA extend ({label})")
            what = f"MLA extend with cached prefix ({label})"
            self._mla_step(runner, ForwardMode.EXTEND, [(r[0], 13, 9), (scattered, 17, 5)], what)
            self._mla_step(runner, ForwardMode.EXTEND, [(r[1], 1, 6), (r[2], 30, 2)], f"{what}, rope apart", split=True)
            self._mla_step(runner, ForwardMode.EXTEND, [(r[2], 32, 3)], f"{what}, a single request")

    def test_mla_decode(self) -> None:
        """The absorbed form in decode, joined and apart, and as SGLang's MLA kit calls it (no k/v)."""
        self._require_mla()
        for dtype, config, label in self._mla_cases():
            runner = self._mla_runner(config, dtype)
            r, scattered = self._mla_prefill(runner, f"MLA decode ({label})")
            rows = [(r[0], 13), (r[1], 1), (scattered, 17), (r[2], 30)]
            for step, (split, from_cache) in enumerate(((False, False), (True, False), (False, True))):
                how = ", rope apart" if split else ", k/v None (written by the caller)" if from_cache else ""
                batch = [(req, n + step, 1) for req, n in rows]
                what = f"MLA decode step {step} ({label}){how}"
                self._mla_step(runner, ForwardMode.DECODE, batch, what, split=split, from_cache=from_cache)
            self._mla_step(runner, ForwardMode.DECODE, [(r[2], 33, 1)], f"MLA decode of a single request ({label})")

    def test_mla_mixed_and_target_verify(self) -> None:
        """MIXED and TARGET_VERIFY (a chain; a tree where ``tree_mask`` is declared) in the absorbed form."""
        self._require_mla()
        trees = self._capabilities().tree_mask
        for dtype, config, label in self._mla_cases():
            runner = self._mla_runner(config, dtype)
            r, scattered = self._mla_prefill(runner, f"MLA mixed ({label})")
            fresh = runner.new_request()
            mixed = [(r[0], 13, 1), (r[1], 1, 7), (fresh, 0, 11), (scattered, 17, 1)]
            self._mla_step(runner, ForwardMode.MIXED, mixed, f"MLA mixed batch ({label})")
            chain = [(r[0], 14, 4), (r[1], 8, 4), (scattered, 18, 4)]
            self._mla_step(runner, ForwardMode.TARGET_VERIFY, chain, f"MLA target-verify chain ({label})")
            if trees:
                parents = (SPECULATIVE_TREES["topk2-6-wide"], SPECULATIVE_TREES["topk3-8-deep"])
                tree = [(r[2], 30, 6), (fresh, 11, 8)]
                self._mla_step(
                    runner,
                    ForwardMode.TARGET_VERIFY,
                    tree,
                    f"MLA target-verify tree ({label}), topk 2 and 3",
                    tree=tree_mask(*parents),
                    split=True,
                )

    def test_mla_draft(self) -> None:
        """Draft extend (v1 and v2) and draft decode over branch rows sharing their request's prefix slots."""
        self._require_mla()
        for dtype, config, label in self._mla_cases():
            runner = self._mla_runner(config, dtype, is_draft=self.entry.draft)
            r, scattered = self._mla_prefill(runner, f"MLA draft ({label})")
            batch = [(r[0], 13, 3), (r[1], 1, 1), (scattered, 17, 2)]
            self._mla_step(runner, ForwardMode.DRAFT_EXTEND_V2, batch, f"MLA draft-extend v2 ({label})")
            self._mla_step(runner, ForwardMode.DRAFT_EXTEND, [(r[2], 30, 4)], f"MLA draft-extend ({label})")
            pool, branches = runner.kv_pool, []
            for request, prefix_len, topk in ((r[0], 16, 3), (scattered, 19, 2)):
                for _ in range(topk):
                    row = runner.new_request()
                    pool.req_to_token[row, :prefix_len] = pool.req_to_token[request, :prefix_len]
                    branches.append((row, prefix_len))
            for step in range(2):
                rows = [(row, prefix_len + step, 1) for row, prefix_len in branches]
                self._mla_step(runner, ForwardMode.DECODE, rows, f"MLA draft decode over branch rows ({label}), {step}")

    def test_mla_production_shape(self) -> None:
        """DeepSeek V3's attention at its served sizes (:data:`MLA_PRODUCTION_SHAPE`): a latent of 512 + 64, 16 heads
        (128 over 8 ranks), three layers, an int32 table, contexts of thousands; an extend of a dozen requests, a
        decode of every request and a target-verify of every other one (a tree seven deep where ``tree_mask`` is
        declared), in the absorbed form, in the backend's first declared float dtype."""
        self._require_mla()
        shape = MLA_PRODUCTION_SHAPE
        dtype = self._declared_float_dtypes()[0]
        page = self._page_size()
        tree = SPECULATIVE_TREES["topk2-10-deep7"] if self._capabilities().tree_mask else None
        verify_len = _CHAIN if tree is None else len(tree)
        longest = max(c + e for c, e in zip(shape.contexts, shape.extend, strict=True))
        slots = sum(shape.contexts) + sum(shape.extend) + len(shape.contexts) * (2 + verify_len + 2 * page)
        runner = self._mla_runner(
            shape.config,
            dtype,
            num_heads=shape.num_heads,
            num_layers=shape.num_layers,
            max_requests=len(shape.contexts),
            max_context_len=longest + 1 + verify_len + page,
            num_slots=-(-slots // page) * page,
            table_dtype=torch.int32,
        )
        label = f"MLA production shape ({shape.model}; {dtype_name(dtype)})"
        pool = runner.kv_pool
        requests = [runner.new_request() for _ in shape.contexts]
        for i, (request, context) in enumerate(zip(requests, shape.contexts, strict=True)):
            if context:
                pages = pool.alloc_pages(-(-context // page))
                held = pool.page_slots(pages.flip(0) if i % 3 == 2 else pages)[:context]
                pool.req_to_token[request, :context] = held
                for layer in runner.layers:
                    rows = self._randn(context, 1, layer.head_dim, dtype=pool.dtype)
                    pool.set_kv(layer.layer_id, held, rows, rows[..., : layer.v_head_dim])
        pairs = zip(requests, shape.contexts, shape.extend, strict=True)
        extend = [(request, context, new) for request, context, new in pairs if new]
        self._mla_step(runner, ForwardMode.EXTEND, extend, f"{label}: extend of {len(extend)} requests", split=True)
        lengths = [c + e for c, e in zip(shape.contexts, shape.extend, strict=True)]
        decode = [(request, length, 1) for request, length in zip(requests, lengths, strict=True)]
        self._mla_step(runner, ForwardMode.DECODE, decode, f"{label}: decode of {len(decode)} requests")
        verify = [
            (request, length + 1, verify_len) for request, length in zip(requests[1::2], lengths[1::2], strict=True)
        ]
        what = f"{label}: target-verify of {len(verify)} requests, " + (
            f"chains of {_CHAIN}" if tree is None else "trees topk2-10-deep7"
        )
        mask = None if tree is None else tree_mask(*[tree] * len(verify))
        self._mla_step(runner, ForwardMode.TARGET_VERIFY, verify, what, tree=mask)

    def test_mla_flat_heads(self) -> None:
        """A backend declaring ``flat_heads`` gets SGLang's ``[T, heads * latent_dim]`` MLA queries too."""
        self._require_mla()
        if not self._capabilities().flat_heads:
            pytest.skip(f"backend {self.name!r} does not declare flat_heads")
        dtype, config, label = self._mla_cases()[0]
        runner = self._mla_runner(config, dtype)
        r, scattered = self._mla_prefill(runner, f"MLA flat heads ({label})")
        self._mla_step(
            runner, ForwardMode.EXTEND, [(r[0], 13, 4), (r[2], 30, 2)], f"MLA flat extend ({label})", flat=True
        )
        self._mla_step(
            runner, ForwardMode.DECODE, [(r[1], 1, 1), (scattered, 17, 1)], f"MLA flat decode ({label})", flat=True
        )

    def test_mla_mha_form(self) -> None:
        """The MHA form over a prefill: causal over its k/v arguments, the latent (written by the caller) left as
        it was; then decode in the absorbed form over that latent."""
        self._require_mla()
        for dtype, config, label in self._mla_cases():
            runner = self._mla_runner(config, dtype)
            requests = [(runner.new_request(), 0, n) for n in (21, 1, 9)]
            what = f"MLA MHA-form prefill ({label})"
            batch = runner.prepare_batch(ForwardMode.EXTEND, requests)
            pool, n = runner.kv_pool, batch.num_new_tokens
            for layer in runner.mha_layers:
                q = self._randn(n, layer.num_heads, layer.head_dim, dtype=dtype)
                k = self._randn(n, layer.num_heads, layer.head_dim, dtype=dtype)
                v = self._randn(n, layer.num_heads, layer.v_head_dim, dtype=dtype)
                latent = self._randn(n, 1, config.latent_dim, dtype=dtype)
                pool.set_kv(
                    layer.layer_id, batch.out_cache_loc, latent, latent[..., : config.kv_lora_rank]
                )  # the model writes the latent
                expected = pool.k_buffer(layer.layer_id).clone()
                try:
                    with torch.no_grad(), runner.forward_context() as backend:
                        out = backend.forward(q, k, v, layer, batch, save_kv_cache=False)
                except Exception as exc:
                    raise AssertionError(
                        f"{what}: forward (MLA MHA form, layer {layer.layer_id}) raised {type(exc).__name__}: {exc}"
                    ) from exc
                self._check_latent(what, pool.k_buffer(layer.layer_id), expected, batch, layer)
                shape = (n, layer.num_heads, layer.v_head_dim)
                if tuple(out.shape) != shape:
                    fail(f"{what}: output {tuple(out.shape)}, expected {shape} (the values are v_head_dim wide)")
                self._compare(what, out, reference_mla_mha(q, k, v, layer, batch), layer, batch)
            decode = [(req, length, 1) for req, _, length in requests]
            self._mla_step(runner, ForwardMode.DECODE, decode, f"MLA decode after an MHA-form prefill ({label})")

    def test_mla_idle_batch(self) -> None:
        self._require_mla()
        runner = self._mla_runner(self.mla_configs[0], torch.float32)
        batch = runner.prepare_batch(ForwardMode.IDLE, [])
        layer = runner.layers[0]
        empty = self._randn(0, layer.num_heads, layer.head_dim, dtype=torch.float32)
        with torch.no_grad(), runner.forward_context() as backend:
            out = backend.forward(empty, empty[:, :1], empty[:, :1, : layer.v_head_dim], layer, batch)
        if tuple(out.shape) != (0, layer.num_heads, layer.v_head_dim):
            fail(f"MLA idle batch: output {tuple(out.shape)}, expected (0, {layer.num_heads}, {layer.v_head_dim})")
