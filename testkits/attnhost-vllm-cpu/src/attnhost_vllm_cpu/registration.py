"""An attnhost backend name as vLLM knows it after its plugin loader ran, or one sentence saying why it is not there.

The suite asks this once per check instead of each test finding its own way
into attnhost's bridge: a name the registry does not know, or a backend
attnhost did not register with vLLM, is then the same message everywhere,
and only the check that owns it fails (the others skip, pointing at it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ENTRY_POINT", "NotInVllmError", "UnknownBackendNameError", "VllmBackend", "lookup", "takeovers"]

ENTRY_POINT = "attnhost = attnhost.engines.vllm:register (group vllm.general_plugins)"
"""attnhost's entry point in vLLM's plugin group, as a failure names it."""


class UnknownBackendNameError(LookupError):
    """The name is not an attnhost backend here; the message is the registry's own (``did you mean ...``)."""


class NotInVllmError(LookupError):
    """attnhost knows the backend but did not register it with vLLM in this process; the message says why."""


@dataclass(frozen=True)
class VllmBackend:
    """One attnhost backend registered with vLLM: its names on both sides and vLLM's enum member for it."""

    attnhost_name: str
    plugin: str
    engine_name: str
    """The ``AttentionBackendEnum`` member name (``--attention-backend`` takes it in any case)."""
    renamed: bool
    """True when vLLM implements the attnhost name itself and attnhost's backend got the ``ATTNHOST_`` name."""
    draft: bool
    member: Any

    @property
    def label(self) -> str:
        return f"attnhost backend {self.attnhost_name!r} (vLLM {self.engine_name})"


def lookup(name: str) -> VllmBackend:
    """The vLLM side of attnhost backend *name* (a canonical name or an alias), after ``load_general_plugins()``.

    Raises :class:`UnknownBackendNameError` or :class:`NotInVllmError` with the sentence a failure should show.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from attnhost.availability import check_availability
    from attnhost.engines.vllm.bridge import current_plan
    from attnhost.engines.vllm.names import vllm_name
    from attnhost.host import get_registry
    from attnhost.platform import current_platform

    registry = get_registry()
    if name not in registry:
        raise UnknownBackendNameError(registry.unknown_message(name))
    entry = registry.entry(name)
    plan = current_plan()
    if plan is None:
        raise NotInVllmError(
            f"attnhost's vLLM plugin did not run in this process: vLLM's load_general_plugins() did not call "
            f"{ENTRY_POINT}; check VLLM_PLUGINS and that attnhost is installed in this environment"
        )
    engine_name = plan.engine_name(entry.name)
    if engine_name is None:
        availability = check_availability(entry, current_platform())
        if not availability.available:
            why = availability.reason
        else:
            why = (
                "; ".join(w for w in plan.warnings if repr(entry.name) in w) or "see `attnhost list " + entry.name + "`"
            )
        raise NotInVllmError(f"attnhost backend {entry.name!r} ({entry.label}) is not registered with vLLM: {why}")
    member = AttentionBackendEnum.__members__.get(engine_name)
    if member is None:
        raise NotInVllmError(
            f"attnhost planned vLLM backend {engine_name!r} for {entry.name!r}, but vLLM's AttentionBackendEnum "
            "has no such member: attnhost's bridge did not register it (a bug in attnhost; please report it)"
        )
    return VllmBackend(
        attnhost_name=entry.name,
        plugin=entry.plugin,
        engine_name=engine_name,
        renamed=engine_name != vllm_name(entry.name),
        draft=entry.draft,
        member=member,
    )


def takeovers() -> dict[str, str]:
    """vLLM's own backends whose class attnhost replaced, without the operator asking (name → class path).

    vLLM's ``register_backend(member, path)`` on an existing member records
    the path in ``_ATTN_OVERRIDES``; a new member's value is its path. So a
    member whose value is not attnhost's class path is vLLM's (or another
    plugin's), and an attnhost path among the overrides of such a member is a
    takeover, unless ``ATTNHOST_VLLM_OVERRIDE`` names its backend.
    """
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    from attnhost.engines.vllm.bridge import ClassPath, exported
    from attnhost.engines.vllm.names import BACKENDS_MODULE

    asked = {engine_name for engine_name, backend in exported().items() if backend.overrides}
    return {
        member.name: str(path)
        for member, path in _ATTN_OVERRIDES.items()
        if not isinstance(member.value, ClassPath)
        and str(path).startswith(BACKENDS_MODULE + ".")
        and member.name not in asked
    }
