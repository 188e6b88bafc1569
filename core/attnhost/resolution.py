"""Which backends the target and the draft model run, and a trace of why.

Operators debug "why is my draft on flashinfer?" from this trace, so every decision appends one readable step.
Inside SGLang the draft decision is SGLang's own resolver, wrapped by the bridge
(:mod:`attnhost.engines.sglang.bridge`, an AROUND hook) so that a plugin's fallback answers there too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from attnhost.availability import check_availability
from attnhost.errors import AttnhostError, describe_exception, printable, printable_record
from attnhost.hooks import call_plugin_hook
from attnhost.host import default_host
from attnhost.platform import current_platform
from attnhost.registry import Registry
from attnhost.server_args import ServerArgs

__all__ = ["DraftResolution", "Resolution", "TargetResolution", "ask_platform_hook", "resolve"]
__all__ += ["resolve_attention_backends", "resolve_draft_attention_backend"]

logger = logging.getLogger(__name__)
logger.addFilter(printable_record)  # plugin text in a log line is escaped


@dataclass(frozen=True, slots=True, kw_only=True)
class _Decision:
    platform: str
    trace: tuple[str, ...]
    """Every step and its reason, in order, as ``attnhost resolve`` prints them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetResolution(_Decision):
    """The target model's prefill and decode backends."""

    prefill: str
    decode: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftResolution(_Decision):
    """The draft model's backend. ``fell_back`` is true only when a named backend (``rejected``) cannot draft."""

    name: str
    fell_back: bool = False
    warning: str | None = None
    """SGLang's warning when a named backend was rejected for drafting."""
    rejected: str | None = None
    available: bool = True
    """Whether ``name`` can run on ``platform`` (a fallback often cannot: flashinfer on a CPU machine)."""
    problem: str | None = None
    """When not ``available``: one sentence saying why, how ``name`` was chosen, and the way out."""


@dataclass(frozen=True, slots=True)
class Resolution:
    """Both resolutions and the warnings they raised, as ``attnhost resolve`` reports them."""

    target: TargetResolution
    draft: DraftResolution
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "platform": self.target.platform,
            "prefill": self.target.prefill,
            "decode": self.target.decode,
            "draft": self.draft.name,
            "draft_fell_back": self.draft.fell_back,
            "draft_available": self.draft.available,
            "draft_problem": self.draft.problem,
            "trace": list(self.target.trace + self.draft.trace),
            "warnings": list(self.warnings),
        }


def ask_platform_hook(hook_name: str, platform: str, registry: Registry, *, draft: bool) -> tuple[str, str]:
    """``(answer, source)``: a firstresult platform hook asked plugin by plugin, in pluggy's order; one that raises
    or answers a name the registry cannot use is skipped with a warning, so it cannot stop resolution."""
    pm = default_host().plugin_manager()
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):  # pluggy calls the last registered first
        plugin = printable(repr(impl.plugin_name))
        where = f"plugin {plugin}: hook {hook_name}({platform!r})"
        try:
            answer = call_plugin_hook(pm, hook_name, impl.plugin_name, None, platform=platform)
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not stop the server either
            logger.warning("%s raised %s; asking the next plugin", where, describe_exception(exc))
            continue
        if answer is None:
            continue
        canonical = registry.canonical(answer) if isinstance(answer, str) else None
        if canonical is None:
            logger.warning("%s answered %s, which is not a registered backend; ignored", where, printable(repr(answer)))
        elif draft and not registry.is_draft_capable(canonical):
            logger.warning("%s answered %r, which is not draft-capable; ignored", where, canonical)
        else:
            return canonical, f"hook {hook_name}, plugin {plugin}"
    raise AttnhostError(f"no plugin answered {hook_name}({platform!r}); is the built-in plugin installed?")


def _runs_here(registry: Registry, names: tuple[str, ...], platform: str) -> list[str]:
    return [name for name in names if check_availability(registry.entry(name), platform).available]


def _draft(registry: Registry, trace: list[str], name: str, how: str, platform: str, **kw: Any) -> DraftResolution:
    """The draft result for ``name``; when it cannot run on ``platform``, the problem and the ways out. The user may
    never have named it (a fallback), so the problem says how it was chosen and which other backend would run."""
    entry = registry.entry(name)
    reason = check_availability(entry, platform).reason
    if reason is None:
        return DraftResolution(name=name, platform=platform, trace=tuple(trace), **kw)
    trace.append(f"draft: {name!r} cannot run on {platform}: {reason} (the way out is under warnings)")
    drafting = _runs_here(registry, registry.names("draft"), platform)
    runs = [] if drafting else _runs_here(registry, registry.names(), platform)
    if drafting:
        way = f"choose one that runs here with --speculative-draft-attention-backend ({', '.join(drafting)})"
    elif runs:
        way = f"make one that runs here draft-capable, e.g. attnhost.add_draft_attention_backend_choices([{runs[0]!r}])"
    else:
        way = f"install a plugin with a backend for {platform}"
    problem = (
        f"draft attention backend {name!r} from {entry.label} ({how}) cannot run on {platform}: {reason}; "
        f"{way}, or install a plugin whose attnhost_draft_fallback hook answers for {platform}"
    )
    return DraftResolution(name=name, platform=platform, trace=tuple(trace), available=False, problem=problem, **kw)


def resolve_attention_backends(args: ServerArgs, platform: str | None = None) -> TargetResolution:
    """The target's ``(prefill, decode)``: the flags, else the platform's default backend."""
    platform = current_platform(platform)
    registry = default_host().registry()
    trace: list[str] = []
    prefill, decode = args.get_attention_backends()
    default = ""
    if prefill is None or decode is None:
        default, source = ask_platform_hook("attnhost_default_attention_backend", platform, registry, draft=False)
        trace.append(f"no attention backend flag set: the default for platform {platform} is {default!r} ({source})")
    for half, chosen in (("prefill", prefill), ("decode", decode)):
        if chosen is None:
            trace.append(f"target {half}: {default!r} (platform default)")
        else:
            specific = getattr(args, f"{half}_attention_backend") is not None
            flag = f"--{half}-attention-backend" if specific else "--attention-backend"
            trace.append(f"target {half}: {chosen!r} (from {flag})")
    return TargetResolution(prefill=prefill or default, decode=decode or default, platform=platform, trace=tuple(trace))


def resolve_draft_attention_backend(args: ServerArgs, platform: str | None = None) -> DraftResolution:
    """The draft worker's backend, exactly as SGLang #35932 decides it, with the reasons; attnhost adds saying, in
    the result, when the chosen backend cannot run here (``available``, ``problem``)."""
    platform = current_platform(platform)
    registry = default_host().registry()
    trace: list[str] = []
    candidate = args.speculative_draft_attention_backend
    how = "given by --speculative-draft-attention-backend"
    if candidate is not None:
        trace.append(f"draft: {candidate!r} {how}")
    elif (candidate := args.get_attention_backends()[0]) is not None:
        how = "inherited from the target's prefill backend"
        trace.append(
            f"draft: no --speculative-draft-attention-backend; inheriting the target's prefill backend {candidate!r}"
        )
    if candidate is not None and registry.is_draft_capable(candidate):
        trace.append(f"draft: {candidate!r} is draft-capable; using it")
        return _draft(registry, trace, candidate, how, platform)
    capable = registry.names("draft")
    fallback, source = ask_platform_hook("attnhost_draft_fallback", platform, registry, draft=True)
    if candidate is None:
        trace.append(
            f"draft: no backend named for target or draft; using the platform fallback {fallback!r} for "
            f"{platform} ({source})"
        )
        how = f"the draft fallback for {platform}, as no backend was named for target or draft"
        return _draft(registry, trace, fallback, how, platform)
    trace.append(f"draft: {candidate!r} is not draft-capable (draft-capable: {', '.join(capable)})")
    trace.append(f"draft: falling back to {fallback!r}, the draft fallback for {platform} ({source})")
    warning = (
        f"draft worker only supports attention backends in [{', '.join(capable)}], but got {candidate!r}; "
        f"falling back to {fallback!r} on {platform}"
    )
    logger.warning("%s", warning)
    how = f"the draft fallback for {platform}, because {candidate!r}, {how}, is not draft-capable"
    return _draft(registry, trace, fallback, how, platform, fell_back=True, rejected=candidate, warning=warning)


def resolve(args: ServerArgs, platform: str | None = None) -> Resolution:
    """Resolve target and draft together, for the CLI and for reports."""
    target = resolve_attention_backends(args, platform)
    draft = resolve_draft_attention_backend(args, target.platform)
    return Resolution(target, draft, tuple(filter(None, (draft.warning, draft.problem))))
