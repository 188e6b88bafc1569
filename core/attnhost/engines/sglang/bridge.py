"""Registers attnhost's backends in SGLang's registries and hooks SGLang where attnhost must decide.

SGLang's own mechanisms, no patch to its source:

* ``ATTENTION_BACKENDS`` (name → ``factory(model_runner)``) and the two
  choice lists, extended in place, so ``--attention-backend`` and
  ``--speculative-draft-attention-backend`` accept the names and the model
  runner builds an :class:`~attnhost.engines.sglang.adapter.SGLangAdapterBackend`.
* A resolution hook on ``handle_attention_backend_compatibility`` (SGLang's
  ``register_resolution_hook``): it re-syncs the registries with attnhost's
  (names added in-process since the plugins loaded), switches CUDA graphs
  off for an adapter without graph support exactly as SGLang does for its
  own ``torch_native`` (and SGLang's prefill graphs always, its decode-phase
  graphs for a speculative algorithm whose graph runners attnhost does not
  drive), and freezes attnhost's registry, so a late
  ``attnhost.add_*_attention_backend_choices`` raises instead of being
  silently ignored.
* An AROUND hook (``HookRegistry``) on SGLang's draft resolver: when SGLang
  would fall back, a third-party plugin's ``attnhost_draft_fallback``
  answer for this platform wins; otherwise SGLang's rule stands.
  DFLASH settles its draft backend earlier, while SGLang resolves the
  arguments (``_resolve_dflash_draft_attention_backend``): the same rule
  applies there, through an AROUND hook on that step, with SGLang's warning.
* An AROUND hook on ``DraftBackendFactory._create_backend``, the one place
  both of SGLang's hard-coded draft maps (``create_decode_backend``,
  ``create_draft_extend_backend``) are looked up: attnhost's names join the
  map SGLang is about to read, so SGLang's own lookup, stamping, wrapping
  and error for unknown names all stay SGLang's. The draft-extend backend
  is an adapter on the draft runner; the decode "backend" is
  :class:`~attnhost.engines.sglang.multistep.SGLangMultiStepDraftBackend`.
  The resolution hook also refuses a speculative tree (``topk > 1``) whose
  target backend declares no ``tree_mask``, before anything is built.
* A resolution hook on ``handle_model_specific_adjustments``, where SGLang
  asserts that gpt-oss runs on one of a hard-coded list of backends (those
  with sliding windows and attention sinks): an attnhost backend that
  declares both passes that check (an AROUND hook on
  ``attention_backends_of``, active only inside it, shows the check a listed
  name in its place); one that does not is refused there by name, with what
  it lacks. SGLang's own names meet SGLang's own check, untouched.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import multiprocessing
import sys
import threading
from collections.abc import Callable
from typing import Any

from attnhost.backend import BackendCapabilities
from attnhost.engines.export import ExportedBackend, ExportPlan, plan_exports
from attnhost.engines.identity import BackendIdentity, LogOnce, declared_capabilities, declares_mla
from attnhost.errors import UnsupportedFeatureError
from attnhost.host import default_host, engine_load_failure
from attnhost.platform import current_platform
from attnhost.settings import SGLANG_OVERRIDE_ENV as OVERRIDE_ENV

__all__ = ["adapter_factory", "capable_backends", "current_plan", "install"]

logger = logging.getLogger("attnhost.engines.sglang")

_DRAFT_RESOLVER = "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend"
_COMPAT_STEP = "handle_attention_backend_compatibility"
_DRAFT_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
_DFLASH_DRAFT_STEP = "sglang.srt.arg_groups.speculative_hook._resolve_dflash_draft_attention_backend"
_MODEL_STEP = "handle_model_specific_adjustments"
_BACKENDS_OF = "sglang.srt.arg_groups.model_override_base.attention_backends_of"
#: Models SGLang lets run only on a hard-coded list of its backends, with the capabilities that list stands for and
#: a name on it the check is shown in an attnhost backend's place (``sglang/srt/arg_groups/model_hook.py``).
_BACKEND_ALLOW_LISTS: dict[str, tuple[tuple[str, ...], str]] = {
    "GptOssForCausalLM": (("sinks", "sliding_window"), "triton"),
}
_stand_in: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("attnhost_stand_in", default=None)

_lock = threading.Lock()
_plan: ExportPlan | None = None
_ours: dict[str, Callable[[Any], Any]] = {}
"""SGLang names this process registered, with the factory it put in ``ATTENTION_BACKENDS``."""
_log_once = LogOnce(logger)
_hooks_installed = False


def current_plan() -> ExportPlan | None:
    """What the last :func:`install` registered in this process (``None`` before it ran)."""
    return _plan


def install() -> None:
    """Register (or re-sync) attnhost's exports with SGLang; idempotent, safe in every process."""
    global _plan, _hooks_installed
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    with _lock:
        try:
            plan = plan_exports(
                "SGLang",
                lambda name: name in ATTENTION_BACKENDS and ATTENTION_BACKENDS[name] is not _ours.get(name),
                override_env=OVERRIDE_ENV,
                taken=tuple(_ours),
            )
        except Exception as exc:  # SGLang logs it as a general plugin's failure; ours says what and why first
            _log_once(logging.ERROR, engine_load_failure("SGLang", exc))
            raise
        for warning in plan.warnings:  # once per engine start: the spawned scheduler, detokenizer... say it at INFO
            _log_once(logging.INFO if multiprocessing.parent_process() else logging.WARNING, warning)
        for backend in plan.backends:
            factory = _ours.get(backend.engine_name) or adapter_factory(backend)
            for name in backend.engine_names:
                ATTENTION_BACKENDS[name] = factory
                _ours[name] = factory
                _append(choices.ATTENTION_BACKEND_CHOICES, name)
                if backend.draft:
                    _append(choices.DRAFT_ATTENTION_BACKEND_CHOICES, name)
        _plan = plan
        _register_mla_dispatch(plan)
        if plan.backends:
            names = ", ".join(
                f"{b.engine_name}{' (draft)' if b.draft else ''}"
                + (f" as attnhost {b.name!r}" if b.engine_name != b.name else "")
                for b in plan.backends
            )
            _log_once(logging.INFO, f"attnhost registered {len(plan.backends)} SGLang attention backend(s): {names}")
        else:
            _log_once(logging.INFO, "attnhost registered no SGLang attention backend (none implemented and available)")
        if not _hooks_installed:
            _install_hooks()
            _hooks_installed = True


def _append(names: list[str], name: str) -> None:
    if name not in names:
        names.append(name)


def _register_mla_dispatch(plan: ExportPlan) -> None:
    """DeepSeek's per-batch choice between MLA's two forms, for the exported names whose backend declares ``mla``
    (an unregistered name would silently get SGLang's ``triton`` rule)."""
    names = [name for backend in plan.backends if declares_mla(backend) for name in backend.engine_names]
    if names:
        from attnhost.engines.sglang.mla import register_deepseek_dispatch

        register_deepseek_dispatch(names)


def adapter_factory(backend: ExportedBackend) -> Callable[[Any], Any]:
    """The ``factory(model_runner)`` SGLang calls: loads the plugin's factory lazily, builds an adapter."""

    def create_attnhost_backend(model_runner: Any) -> Any:
        from attnhost.engines.sglang.adapter import SGLangAdapterBackend, runner_flag
        from attnhost.engines.sglang.mla import SGLangMLAAdapterBackend

        default_host().freeze(by="building an SGLang model runner")
        identity = BackendIdentity.of(backend, backend.engine_name, "SGLang", flag=runner_flag(model_runner))
        adapter = SGLangMLAAdapterBackend if getattr(model_runner, "use_mla_backend", False) else SGLangAdapterBackend
        return adapter(
            model_runner,
            engine_name=identity.engine_name,
            attnhost_name=identity.attnhost_name,
            origin=identity.origin,
            factory=identity.factory,
            capabilities=identity.capabilities,
            capable_peers=capable_backends,
            distribution=identity.distribution,
        )

    create_attnhost_backend.__qualname__ = f"create_attnhost_backend[{backend.engine_name}]"
    return create_attnhost_backend


def _capabilities(engine_name: str | None) -> BackendCapabilities | None:
    """The capabilities of an attnhost adapter name, or ``None`` for one of SGLang's own names."""
    if engine_name is None or _plan is None:
        return None
    backend = _plan.by_engine_name(engine_name)
    if backend is None or engine_name not in _ours:
        return None
    declared = declared_capabilities(backend)
    return BackendCapabilities() if declared is None else declared  # unloadable: the runner says why; no graphs


# -- SGLang hooks ----------------------------------------------------------------------


def _install_hooks() -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_resolution_hook(_COMPAT_STEP)(_attention_compatibility)
    register_resolution_hook(_MODEL_STEP)(_model_adjustments)
    HookRegistry.register(_BACKENDS_OF, _backends_of, HookType.AROUND)
    HookRegistry.register(_DRAFT_RESOLVER, _resolve_draft_backend, HookType.AROUND)
    HookRegistry.register(_DFLASH_DRAFT_STEP, _resolve_dflash_draft_backend, HookType.AROUND)
    HookRegistry.register(_DRAFT_FACTORY, _draft_backend, HookType.AROUND)
    from attnhost.engines.sglang.agreement import install_agreement_check  # every rank must agree

    install_agreement_check()


_CAPTURED_ALGORITHMS = frozenset({"NONE", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"})
"""The speculative algorithms whose decode-phase graphs the adapter captures (NEXTN is SGLang's alias of EAGLE):
the target's decode or verify graph (``DecodeCudaGraphRunner``) and EAGLE's draft-decode graph
(``EAGLEDraftCudaGraphRunner``, the multi-step container). Others (DFLASH's draft, frozen-KV MTP) bring graph
runners of their own, which attnhost does not drive."""


def _attention_compatibility(server_args: Any, previous: Callable[[Any], None]) -> None:
    """SGLang's attention step, with attnhost's registrations current and graphs off where unsupported."""
    install()  # pick up in-process registrations made after the plugins loaded
    previous(server_args)
    default_host().freeze(by="SGLang's server-argument resolution")
    from sglang.srt.arg_groups.overrides import declare_resolution, resolved_view, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    view = resolved_view(server_args)
    _refuse_unsupported_trees(view)
    names = {
        getattr(view, field, None)
        for field in (
            "attention_backend",
            "prefill_attention_backend",
            "decode_attention_backend",
            "speculative_draft_attention_backend",
        )
    }
    ours = sorted(name for name in names if isinstance(name, str) and _capabilities(name) is not None)
    no_graph = [name for name in ours if not _capabilities(name).cuda_graph]  # type: ignore[union-attr]
    algorithm = str(getattr(view, "speculative_algorithm", None) or "NONE").upper()
    uncaptured = algorithm not in _CAPTURED_ALGORITHMS
    if no_graph:
        logger.warning(
            "CUDA graph is disabled because attnhost backend(s) %s declare no CUDA-graph support", ", ".join(no_graph)
        )
    elif ours and uncaptured:
        logger.warning(
            "CUDA graph is disabled for attnhost backend(s) %s in %s speculative decoding: attnhost captures the "
            "graphs of plain decoding and of %s (docs/graphs.md)",
            ", ".join(ours),
            algorithm,
            ", ".join(sorted(_CAPTURED_ALGORITHMS - {"NONE", "NEXTN"})),
        )
    elif ours:  # decode, verify and draft-decode graphs through the adapter; SGLang's prefill graphs are not ours
        logger.info(
            "Prefill CUDA graphs are disabled for attnhost backend(s) %s (decode-phase graphs only)", ", ".join(ours)
        )
    if not ours:
        return
    phases = (Phase.PREFILL,) if not no_graph and not uncaptured else (Phase.DECODE, Phase.PREFILL)
    for phase in phases:
        config = resolving_view(server_args).cuda_graph_config
        declare_resolution(
            server_args,
            "attnhost_attention_backend_compatibility",
            cuda_graph_config=with_phase(config, phase, backend=Backend.DISABLED),
        )


def capable_backends(features: tuple[str, ...]) -> list[str]:
    """The exported attnhost backends (SGLang names) that declare every one of *features*."""
    names = []
    for name in sorted(_ours):
        caps = _capabilities(name)
        if caps is not None and all(getattr(caps, feature, False) for feature in features):
            names.append(name)
    return names


def _model_adjustments(server_args: Any, previous: Callable[[Any], None]) -> None:
    """SGLang's model-specific step, with its backend allow-list for a model (gpt-oss) opened to the attnhost
    backends that declare what the list stands for, and an attnhost backend that does not refused by name."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view

    try:
        architectures = model_config_of(server_args).hf_config.architectures or []
    except Exception:  # no model config to read: SGLang's step says why, if it matters
        architectures = []
    listed = _BACKEND_ALLOW_LISTS.get(architectures[0]) if architectures else None
    if listed is None:
        previous(server_args)
        return
    needs, stand_in = listed
    view = resolved_view(server_args)
    names = {
        view.prefill_attention_backend or view.attention_backend,
        view.decode_attention_backend or view.attention_backend,
    }
    ours = {}
    for name in sorted(n for n in names if isinstance(n, str)):
        caps = _capabilities(name)
        if caps is None:
            continue  # SGLang's own name: SGLang's own check
        missing = [feature for feature in needs if not getattr(caps, feature)]
        if missing:
            capable = capable_backends(needs)
            raise UnsupportedFeatureError(
                f"attnhost backend {name!r} ({_origin(name)}) cannot serve {architectures[0]} "
                f"({model_config_of(server_args).model_path}): the model needs {' and '.join(needs)}, and it does "
                f"not declare {', '.join(missing)}; choose with --attention-backend a backend that declares them"
                + (f", e.g. {', '.join(capable)}" if capable else "")
            )
        ours[name] = stand_in
    token = _stand_in.set(ours or None)
    try:
        previous(server_args)
    finally:
        _stand_in.reset(token)


def _backends_of(original: Callable[..., tuple[Any, Any]], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """SGLang's ``attention_backends_of``; inside :func:`_model_adjustments` only, a capable attnhost backend shows
    the allow-list check the listed name standing for what it declares."""
    prefill, decode = original(*args, **kwargs)
    stand_in = _stand_in.get()
    if stand_in is None:
        return prefill, decode
    return stand_in.get(prefill, prefill), stand_in.get(decode, decode)


def _origin(name: str) -> str:
    backend = _plan.by_engine_name(name) if _plan is not None else None
    return "attnhost" if backend is None else backend.entry.label


def _refuse_unsupported_trees(view: Any) -> None:
    """A speculative tree (``--speculative-eagle-topk`` > 1) needs a tree mask in the target's verify: refuse
    it now, in one sentence, for an attnhost target backend that does not declare one (never on a batch).

    The draft needs none: its tree branches reach a backend as plain decode rows (see ``multistep``).
    """
    if not getattr(view, "speculative_algorithm", None) or (getattr(view, "speculative_eagle_topk", 1) or 1) <= 1:
        return
    fields = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    targets = {getattr(view, field, None) for field in fields}
    for name in sorted(n for n in targets if isinstance(n, str)):
        caps = _capabilities(name)
        backend = _plan.by_engine_name(name) if _plan is not None else None
        if caps is not None and not caps.tree_mask and backend is not None:
            raise UnsupportedFeatureError(
                f"attnhost backend {name!r} ({backend.entry.label}) declares no tree_mask capability, so it cannot "
                f"verify the speculative tree --speculative-eagle-topk {view.speculative_eagle_topk} asks for; use "
                "--speculative-eagle-topk 1 (chains), or a target --attention-backend that declares tree_mask"
            )


def _draft_backend(
    original: Callable[..., Any],
    factory: Any,
    backend_name: str,
    backend_map: dict[str, Callable[[], tuple[str, Any]]],
    error_template: str,
    stamps_children: bool = False,
) -> Any:
    """SGLang's draft-backend lookup, with attnhost's exported names in the map it reads.

    ``stamps_children`` is how SGLang asks for the multi-step decode container (it stamps each
    ``attn_backends`` child); otherwise it wants the draft runner's draft-extend backend. EAGLE and
    STANDALONE drafts with no backend of their own inherit the target's even when it cannot draft
    (SGLang's fallback resolver serves only its DFLASH workers): there the mission's rule applies, and a
    third-party ``attnhost_draft_fallback`` answer for this platform drafts instead.
    """
    from sglang.srt.runtime_context import attention_backends

    if factory.draft_attn_backend is None:
        prefill, decode = attention_backends()
        inherited = decode if backend_name == "decode_attention_backend" else prefill
        factory.draft_attn_backend = _plugin_fallback(inherited)
    runner = factory.draft_model_runner
    ours: dict[str, Callable[[], tuple[str, Any]]] = {}
    for name, build in _ours.items():
        if stamps_children:
            ours[name] = functools.partial(_multistep, name, build, runner, factory.topk, factory.speculative_num_steps)
        else:
            ours[name] = functools.partial(_single, name, build, runner)
    return original(factory, backend_name, {**backend_map, **ours}, error_template, stamps_children=stamps_children)


def _single(name: str, build: Callable[[Any], Any], runner: Any) -> tuple[str, Any]:
    return name, build(runner)


def _multistep(name: str, build: Callable[[Any], Any], runner: Any, topk: int, steps: int) -> tuple[str, Any]:
    from attnhost.engines.sglang.multistep import SGLangMultiStepDraftBackend

    return name, SGLangMultiStepDraftBackend(runner, topk, steps, functools.partial(build, runner))


def _resolve_draft_backend(original: Callable[..., str], *args: Any, **kwargs: Any) -> str:
    """SGLang's draft resolver, except that a third-party fallback answer for this platform wins a fallback."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    answer = _plugin_fallback(get_spec().speculative_draft_attention_backend or attention_backends()[0])
    return answer if answer is not None else original(*args, **kwargs)


def _resolve_dflash_draft_backend(original: Callable[..., None], server_args: Any, *args: Any, **kwargs: Any) -> None:
    """SGLang's DFLASH draft resolution, except that where SGLang would fall back to the platform's default, a
    third-party plugin's ``attnhost_draft_fallback`` answer for this platform decides, with SGLang's warning.

    SGLang settles a DFLASH draft's backend while it resolves the arguments (``_handle_dflash``), before its
    draft-worker resolver runs, so the rule has to apply here; the resolver then keeps the settled name. What
    "can draft" means is SGLang's own test for DFLASH: the platform's answer on an out-of-tree platform, else
    SGLang's draft choices. Without a plugin's answer (or with one DFLASH cannot use), SGLang's step stands.
    """
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.arg_groups.overrides import (
        attention_backends_of,
        declare_resolution,
        resolved_view,
        resolving_view,
    )
    from sglang.srt.platforms import current_platform as engine_platform

    def drafts(name: str) -> bool:
        if engine_platform.is_out_of_tree():
            return bool(engine_platform.supports_speculative_draft_attention_backend("DFLASH", name))
        return name in DRAFT_ATTENTION_BACKEND_CHOICES

    named = resolving_view(server_args).speculative_draft_attention_backend
    if named is None:
        named, _ = attention_backends_of(resolved_view(server_args))
    answer = None if named is not None and drafts(named) else third_party_draft_fallback()
    if answer is None or not drafts(answer):
        original(server_args, *args, **kwargs)
        return
    if named is not None:  # SGLang's own words for a fallback, from SGLang's logger
        logging.getLogger("sglang.srt.arg_groups.speculative_hook").warning(
            "DFLASH draft worker does not support attention_backend %r on %s. Falling back to '%s'.",
            named,
            type(engine_platform).__name__,
            answer,
        )
    why = "no attention backend named" if named is None else f"{named!r} cannot draft for DFLASH"
    _log_once(
        logging.WARNING,
        f"DFLASH draft: {why}; using {answer!r}, the draft fallback a plugin gives for {current_platform()} "
        "(hook attnhost_draft_fallback)",
    )
    declare_resolution(
        server_args, "_resolve_dflash_draft_attention_backend", speculative_draft_attention_backend=answer
    )


def _plugin_fallback(named: str | None) -> str | None:
    """A third-party plugin's draft fallback when ``named`` cannot draft (or there is none), else ``None``."""
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

    if named is not None and named in DRAFT_ATTENTION_BACKEND_CHOICES:
        return None  # SGLang uses the named backend: nothing to decide
    answer = third_party_draft_fallback()
    if answer is not None:
        why = "no attention backend named" if named is None else f"{named!r} is not draft-capable"
        _log_once(
            logging.WARNING,
            f"draft worker: {why}; using {answer!r}, the draft fallback a plugin gives for {current_platform()} "
            "(hook attnhost_draft_fallback)",
        )
    return answer


def third_party_draft_fallback() -> str | None:
    """A non-built-in plugin's ``attnhost_draft_fallback`` answer, spelled as SGLang knows it, else ``None``."""
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

    pm = default_host().plugin_manager()
    builtin = [plugin for plugin in pm.get_plugins() if plugin is sys.modules.get("attnhost_builtin")]
    caller = pm.subset_hook_caller("attnhost_draft_fallback", remove_plugins=builtin)
    platform = current_platform()
    try:
        answer = caller(platform=platform)
    except Exception as exc:
        logger.warning(
            "a plugin's attnhost_draft_fallback(%r) raised %s: %s; ignored", platform, type(exc).__name__, exc
        )
        return None
    if answer is None:
        return None
    spelled = (_plan.engine_name(answer) if _plan is not None else None) or answer
    if spelled not in DRAFT_ATTENTION_BACKEND_CHOICES:
        logger.warning(
            "a plugin's attnhost_draft_fallback(%r) answered %r, which SGLang cannot use for drafting; ignored",
            platform,
            answer,
        )
        return None
    return str(spelled)
