"""Property tests: random plugin sets, args and platforms against the registry and the resolver.

Hypothesis builds random in-process plugins (colliding names, aliases,
declared-only and implemented specs, draft lists naming anything, fallback
hooks answering anything or raising) and random ``ServerArgs`` values, valid
and not. The invariants are the documented contract: only the documented
errors escape; the draft backend is draft-capable (a fallback is the
platform's answer); the fallback warning is logged exactly when it fell back;
the registry never changes after the freeze.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import attnhost
from attnhost import (
    AttnhostError,
    BackendSpec,
    PlatformError,
    RegistryFrozenError,
    ServerArgs,
    UnknownBackendError,
)
from attnhost.availability import check_availability
from attnhost.host import _reset_for_tests
from attnhost.resolution import resolve
from attnhost.server_args import SPECULATIVE_ATTENTION_MODES

# A small pool, so plugins collide with each other, with the built-ins and with aliases.
POOL = ("a", "b", "c", "d_1", "fa3", "flashinfer", "triton", "torch_native", "dsa", "nsa", "flashmla", "aiter")
INVALID = ("", "bad name!", "flashinfr", "zzz")
PLATFORMS = ("cuda", "rocm", "cpu", "xpu", "npu", "mps", "CUDA", "tpu-ish", None)
RAISE = "<raise>"

names = st.sampled_from(POOL)
spec_plans = st.tuples(names, st.booleans(), st.lists(names, max_size=2, unique=True))
fallback_answers = st.one_of(st.none(), names, st.sampled_from([RAISE, 42, "zzz"]))


@dataclass(frozen=True)
class PluginPlan:
    specs: tuple[tuple[str, bool, tuple[str, ...]], ...]
    drafts: tuple[str, ...]
    fallback: object


plugin_plans = st.builds(
    PluginPlan,
    specs=st.lists(spec_plans, max_size=3).map(lambda xs: tuple((n, i, tuple(a)) for n, i, a in xs)),
    drafts=st.lists(names, max_size=3).map(tuple),
    fallback=fallback_answers,
)
# Mostly unset or a pool name (which may or may not be registered); now and then an invalid one.
arg_values = st.sampled_from([None] * 24 + list(POOL) * 2 + list(INVALID[:2]))
server_kwargs = st.fixed_dictionaries(
    {
        "attention_backend": st.one_of(arg_values, arg_values, arg_values, st.sampled_from(INVALID)),
        "prefill_attention_backend": arg_values,
        "decode_attention_backend": arg_values,
        "speculative_draft_attention_backend": arg_values,
        "speculative_attention_mode": st.sampled_from([*SPECULATIVE_ATTENTION_MODES * 4, "sideways"]),
    }
)


def _plugin(plan: PluginPlan) -> object:
    class Generated:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[BackendSpec]:
            return [
                BackendSpec(name=name, factory="generated_kernels:Backend" if implemented else None, aliases=aliases)
                for name, implemented, aliases in plan.specs
            ]

        @attnhost.hookimpl
        def attnhost_draft_attention_backends(self) -> list[str]:
            return list(plan.drafts)

        @attnhost.hookimpl
        def attnhost_draft_fallback(self, platform: str) -> Any:
            if plan.fallback == RAISE:
                raise RuntimeError("fallback hook exploded")
            return plan.fallback

    return Generated()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _fresh_host(plans: list[PluginPlan]) -> Iterator[_Records]:
    """A host holding only the built-ins plus ``plans``, and the warnings it logs."""
    records = _Records()
    logger = logging.getLogger("attnhost")
    with mock.patch.dict(os.environ, {"ATTNHOST_DISABLE_PLUGIN_AUTOLOAD": "1"}):
        _reset_for_tests()
        logger.addHandler(records)
        try:
            for index, plan in enumerate(plans):
                attnhost.register_plugin(_plugin(plan), name=f"generated-{index}")
            yield records
        finally:
            logger.removeHandler(records)
            _reset_for_tests()


def _expected_fallback(plans: list[PluginPlan], platform: str) -> str:
    """pluggy asks the last-registered plugin first; invalid answers are skipped; the built-in answers last."""
    registry = attnhost.get_registry()
    for plan in reversed(plans):
        answer = plan.fallback
        if isinstance(answer, str) and answer != RAISE and registry.is_draft_capable(answer):
            canonical = registry.canonical(answer)
            assert canonical is not None
            return canonical
    return "triton" if platform == "rocm" else "flashinfer"


SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(SETTINGS, max_examples=300)
@given(plans=st.lists(plugin_plans, max_size=4), kwargs=server_kwargs, platform=st.sampled_from(PLATFORMS))
def test_resolver_raises_only_documented_errors_and_keeps_its_promises(
    plans: list[PluginPlan], kwargs: dict[str, Any], platform: str | None
) -> None:
    with _fresh_host(plans) as records:
        registry = attnhost.get_registry()
        try:
            args = ServerArgs(**kwargs)
        except UnknownBackendError as exc:
            bad = [v for k, v in kwargs.items() if k != "speculative_attention_mode" and v is not None]
            assert any(v not in registry for v in bad), exc
            event("unknown backend")
            return
        except ValueError as exc:
            assert kwargs["speculative_attention_mode"] not in SPECULATIVE_ATTENTION_MODES, exc
            event("bad mode")
            return
        records.messages.clear()
        try:
            result = resolve(args, platform)
        except PlatformError:
            assert platform is not None and platform.lower() not in ("cuda", "rocm", "cpu", "xpu", "npu", "mps")
            event("bad platform")
            return
        except AttnhostError as exc:  # documented: no plugin answered the fallback (cannot happen with built-ins)
            raise AssertionError(f"the built-in plugin always answers: {exc}") from exc
        draft = result.draft
        event(f"resolved (fell back: {draft.fell_back}, plugin fallback: {draft.name not in ('triton', 'flashinfer')})")
        assert registry.is_draft_capable(draft.name)
        fallback = _expected_fallback(plans, draft.platform)
        candidate = args.speculative_draft_attention_backend or args.get_attention_backends()[0]
        if candidate is None:
            assert draft.name == fallback and not draft.fell_back
        elif registry.is_draft_capable(candidate):
            assert draft.name == registry.canonical(candidate) and not draft.fell_back
        else:
            assert draft.fell_back and draft.name == fallback
        fell_back_warnings = [m for m in records.messages if m.startswith("draft worker only supports")]
        assert len(fell_back_warnings) == int(draft.fell_back)
        runs_here = check_availability(registry.entry(draft.name), draft.platform).available
        assert draft.available is runs_here and (draft.problem is None) is runs_here
        assert draft.problem is None or repr(draft.name) in draft.problem
        assert result.warnings == ((draft.warning,) if draft.fell_back else ()) + (
            () if runs_here else (draft.problem,)
        )
        prefill, decode = args.get_attention_backends()
        assert result.target.prefill in registry and result.target.decode in registry
        assert prefill is None or result.target.prefill == prefill
        assert decode is None or result.target.decode == decode
        assert resolve(args, platform) == result, "resolution is deterministic"


@SETTINGS
@given(plans=st.lists(plugin_plans, max_size=4), late=plugin_plans, late_names=st.lists(names, min_size=1, max_size=2))
def test_registry_is_consistent_and_never_changes_after_the_freeze(
    plans: list[PluginPlan], late: PluginPlan, late_names: list[str]
) -> None:
    with _fresh_host(plans):
        registry = attnhost.get_registry()
        names_before = registry.names()
        assert len(set(names_before)) == len(names_before)
        assert set(registry.names("draft")) <= set(names_before)
        for alias, canonical in registry.aliases().items():
            assert canonical in names_before and alias not in names_before
        for name in ("torch_native", "flashinfer", "triton", "dsa"):
            assert name in registry, "a plugin can never remove a built-in name"
        assert registry.canonical("nsa") == "dsa"
        assert registry.is_draft_capable("flashinfer") and registry.is_draft_capable("triton")
        entries = registry.entries()
        aliases = dict(registry.aliases())
        drafts = registry.names("draft")

        ServerArgs()  # freezes
        for attempt in (
            lambda: attnhost.register_plugin(_plugin(late), name="late"),
            lambda: attnhost.add_attention_backend_choices(late_names),
            lambda: attnhost.add_draft_attention_backend_choices(late_names),
            lambda: attnhost.get_plugin_manager().register(_plugin(late), name="late-direct"),
        ):
            try:
                attempt()
            except RegistryFrozenError:
                pass
            else:
                raise AssertionError("a registration after the freeze must raise")
        after = attnhost.get_registry()
        assert after is registry
        assert after.names() == names_before and after.entries() == entries
        assert dict(after.aliases()) == aliases and after.names("draft") == drafts
