"""Who an attnhost backend is inside vLLM: the shared :class:`~attnhost.engines.identity.BackendIdentity`, plus its
twin under vLLM's other kind of model and the way vLLM's selector reasons are explained.

vLLM keeps MLA backend classes apart from dense ones, so a backend that declares ``mla`` has two vLLM names
(:mod:`attnhost.engines.vllm.mla_names`); each name's refusals point at the other where a model of the other kind
asked for it. vLLM's names are identifiers, written as its flag takes them (``--attention-backend TORCH_NATIVE``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnhost.engines.identity import BackendIdentity
from attnhost.engines.vllm.variants import explain_reason

if TYPE_CHECKING:
    from attnhost.engines.export import ExportedBackend

__all__ = ["VLLMIdentity", "identify"]


@dataclass(frozen=True, slots=True)
class VLLMIdentity(BackendIdentity):
    """Which attnhost backend a vLLM name serves, and how errors name it."""

    sibling: str | None = None
    """The vLLM name of the same attnhost backend in the other role (the MLA backend of a dense name, the dense
    backend of an MLA name), for refusals that name the way out; ``None`` when there is none."""

    @property
    def selected_as(self) -> str:
        return f"{self.engine} {self.flag} {self.engine_name}"

    def sibling_way_out(self, mla: bool) -> str | None:
        """Where a model of the other kind goes (its MLA or its dense name), if this backend serves both."""
        if self.sibling is None:
            return None
        return f"select its {'MLA' if mla else 'dense'} backend, {self.flag} {self.sibling.lower()}"

    def explain(self, reason: str) -> str:
        """One of vLLM's selection reasons, with the way out where attnhost knows it."""
        if reason == "MLA not supported":
            return f"{reason}: {self.sibling_way_out(True) or 'it does not declare BackendCapabilities.mla'}"
        if reason == "non-MLA not supported" and self.sibling is not None:
            return f"{reason}: {self.sibling_way_out(False)}"
        return explain_reason(reason, self.capabilities) or reason


def identify(engine_name: str, backend: ExportedBackend, sibling: str | None = None) -> VLLMIdentity:
    """The identity of the backend registered as ``engine_name``, its factory loaded (a failure names backend,
    plugin and way out: :meth:`BackendIdentity.of`)."""
    return VLLMIdentity.of(backend, engine_name, "vLLM", sibling=sibling)
