"""Which backends the target and the draft model run, and a trace of why.

Operators debug "why is my draft on flashinfer?" from this trace, so every
decision appends one readable step. The draft rule is SGLang #35932's:
explicit → inherit the target's prefill backend → platform fallback, with a
backend that cannot draft replaced by the platform's fallback (and a logged
warning). Draft capability is asked of the registry only — no private list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from attnhost.errors import AttnhostError, describe_exception
from attnhost.host import default_host
from attnhost.platform import current_platform
from attnhost.registry import Registry
from attnhost.server_args import ServerArgs

__all__ = [
    "DraftResolution",
    "Resolution",
    "TargetResolution",
    "resolve",
    "resolve_attention_backends",
    "resolve_draft_attention_backend",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Decision:
    platform: str
    """The platform the names were resolved for."""
    trace: tuple[str, ...]
    """Every step and its reason, in order, as ``attnhost resolve`` prints them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetResolution(_Decision):
    """The target model's prefill and decode backends."""

    prefill: str
    decode: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftResolution(_Decision):
    """The draft model's backend. ``fell_back`` is true only when a named backend was rejected."""

    name: str
    fell_back: bool
    warning: str | None = None


@dataclass(frozen=True, slots=True)
class Resolution:
    """Both resolutions and the warnings they raised, as ``attnhost resolve`` reports them."""

    target: TargetResolution
    draft: DraftResolution
    warnings: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "platform": self.target.platform,
            "prefill": self.target.prefill,
            "decode": self.target.decode,
            "draft": self.draft.name,
            "draft_fell_back": self.draft.fell_back,
            "trace": list(self.target.trace + self.draft.trace),
            "warnings": list(self.warnings),
        }


def _ask_platform_hook(hook_name: str, platform: str, registry: Registry, *, draft: bool) -> tuple[str, str]:
    """Call a firstresult platform hook in pluggy's order, attributing the answer to its plugin.

    An implementation that raises or answers with a name the registry cannot
    use is skipped with a warning, so one broken platform plugin cannot stop
    resolution while the built-in answer still exists.
    """
    pm = default_host().plugin_manager()
    caller = getattr(pm.hook, hook_name)
    for impl in reversed(caller.get_hookimpls()):
        try:
            answer = impl.function(platform=platform)
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not stop the server either
            logger.warning(
                "plugin %r: hook %s(%r) raised %s; asking the next plugin",
                impl.plugin_name,
                hook_name,
                platform,
                describe_exception(exc),
            )
            continue
        if answer is None:
            continue
        canonical = registry.canonical(answer) if isinstance(answer, str) else None
        problem = None
        if canonical is None:
            problem = f"answered {answer!r}, which is not a registered backend"
        elif draft and not registry.is_draft_capable(canonical):
            problem = f"answered {canonical!r}, which is not draft-capable"
        if problem:
            logger.warning("plugin %r: hook %s(%r) %s; ignored", impl.plugin_name, hook_name, platform, problem)
            continue
        assert canonical is not None
        return canonical, impl.plugin_name
    raise AttnhostError(f"no plugin answered {hook_name}({platform!r}); is the built-in plugin installed?")


def resolve_attention_backends(args: ServerArgs, platform: str | None = None) -> TargetResolution:
    """The target's ``(prefill, decode)``: the flags, else the platform's default backend."""
    platform = current_platform(platform)
    registry = default_host().registry()
    trace: list[str] = []
    prefill, decode = args.get_attention_backends()
    default: str | None = None
    if prefill is None or decode is None:
        default, plugin = _ask_platform_hook("attnhost_default_attention_backend", platform, registry, draft=False)
        trace.append(
            f"no attention backend flag set: the default for platform {platform} is {default!r} "
            f"(hook attnhost_default_attention_backend, plugin {plugin!r})"
        )
    for half, chosen, specific in (
        ("prefill", prefill, args.prefill_attention_backend),
        ("decode", decode, args.decode_attention_backend),
    ):
        if chosen is None:
            trace.append(f"target {half}: {default!r} (platform default)")
        elif specific is not None:
            trace.append(f"target {half}: {chosen!r} (from --{half}-attention-backend)")
        else:
            trace.append(f"target {half}: {chosen!r} (from --attention-backend)")
    final_prefill = prefill or default
    final_decode = decode or default
    assert final_prefill is not None and final_decode is not None
    return TargetResolution(prefill=final_prefill, decode=final_decode, platform=platform, trace=tuple(trace))


def resolve_draft_attention_backend(args: ServerArgs, platform: str | None = None) -> DraftResolution:
    """The draft worker's backend, exactly as SGLang #35932 decides it, with the reasons."""
    platform = current_platform(platform)
    registry = default_host().registry()
    trace: list[str] = []
    candidate = args.speculative_draft_attention_backend
    if candidate is not None:
        trace.append(f"draft: {candidate!r} given by --speculative-draft-attention-backend")
    else:
        candidate = args.get_attention_backends()[0]
        if candidate is not None:
            trace.append(
                "draft: no --speculative-draft-attention-backend; "
                f"inheriting the target's prefill backend {candidate!r}"
            )
    if candidate is None:
        fallback, plugin = _ask_platform_hook("attnhost_draft_fallback", platform, registry, draft=True)
        trace.append(
            f"draft: no backend named for target or draft; using the platform fallback {fallback!r} for "
            f"{platform} (hook attnhost_draft_fallback, plugin {plugin!r})"
        )
        return DraftResolution(name=fallback, fell_back=False, platform=platform, trace=tuple(trace))
    if registry.is_draft_capable(candidate):
        trace.append(f"draft: {candidate!r} is draft-capable; using it")
        return DraftResolution(name=candidate, fell_back=False, platform=platform, trace=tuple(trace))
    capable = registry.names("draft")
    fallback, plugin = _ask_platform_hook("attnhost_draft_fallback", platform, registry, draft=True)
    trace.append(f"draft: {candidate!r} is not draft-capable (draft-capable: {', '.join(capable)})")
    trace.append(
        f"draft: falling back to {fallback!r}, the draft fallback for {platform} "
        f"(hook attnhost_draft_fallback, plugin {plugin!r})"
    )
    warning = (
        f"draft worker only supports attention backends in [{', '.join(capable)}], but got {candidate!r}; "
        f"falling back to {fallback!r} on {platform}"
    )
    logger.warning("%s", warning)
    return DraftResolution(name=fallback, fell_back=True, platform=platform, trace=tuple(trace), warning=warning)


def resolve(args: ServerArgs, platform: str | None = None) -> Resolution:
    """Resolve target and draft together, for the CLI and for reports."""
    target = resolve_attention_backends(args, platform)
    draft = resolve_draft_attention_backend(args, target.platform)
    warnings = (draft.warning,) if draft.warning else ()
    return Resolution(target, draft, warnings)
