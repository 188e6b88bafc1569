"""The vLLM names of attnhost's MLA backends: one more enum member per exported backend that declares ``mla``.

vLLM keeps MLA and dense attention in separate backend classes: a class is
either MLA or not (``AttentionBackend.is_mla()``), vLLM's selector refuses
the other kind (``validate_configuration``), and ``MLAAttention`` takes only
an MLA class. vLLM names its own pairs that way (``TRITON_ATTN`` and
``TRITON_MLA``, ``CPU_ATTN`` and ``CPU_MLA``), so an attnhost backend that
declares ``BackendCapabilities.mla`` is registered twice: its dense name
(``TORCH_NATIVE``) and that name with ``_MLA`` appended
(``TORCH_NATIVE_MLA``), selected with ``--attention-backend
torch_native_mla`` or, next to a dense name, with ``backend_per_kind``
``{"mla_attention": "torch_native_mla"}``.

The clash rule is the dense names' (:mod:`attnhost.engines.export`): an MLA
name vLLM already has keeps vLLM's backend and attnhost's becomes
``ATTNHOST_<NAME>_MLA``, with one warning, unless the operator's
``ATTNHOST_VLLM_OVERRIDE`` names the backend. Aliases get no MLA name.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from attnhost.engines.export import CLASH_PREFIX, ExportedBackend, ExportPlan

__all__ = ["MLA_SUFFIX", "MLAExport", "plan_mla_exports"]

MLA_SUFFIX = "_MLA"
"""What vLLM appends to a backend's name for its MLA sibling (``TRITON_MLA``, ``CPU_MLA``)."""


@dataclass(frozen=True, slots=True)
class MLAExport:
    """One attnhost backend's MLA name in vLLM."""

    engine_name: str
    """The MLA enum member's name (``TORCH_NATIVE_MLA``)."""
    backend: ExportedBackend
    """The backend, exported under its dense name ``backend.engine_name``."""
    overrides: bool
    """True when it replaces vLLM's own backend of that name, as the operator asked."""


def plan_mla_exports(
    plan: ExportPlan,
    declares_mla: Callable[[ExportedBackend], bool],
    engine_has: Callable[[str], bool],
    taken: Collection[str],
    to_engine_name: Callable[[str], str],
) -> tuple[list[MLAExport], list[str]]:
    """The MLA names for ``plan``'s backends that ``declares_mla``, and one warning per decision to report.

    ``engine_has(name)``: vLLM implements ``name`` itself; ``taken``: names
    attnhost registered in this process (dense ones included), which a
    second call keeps as they are; ``to_engine_name``: how the plan spelled
    attnhost names (``names.vllm_name``).
    """
    exports: list[MLAExport] = []
    warnings: list[str] = []
    owners = {backend.engine_name: backend for backend in plan.backends}
    for backend in plan.backends:
        if not declares_mla(backend):
            continue
        name, overrides = backend.engine_name + MLA_SUFFIX, False
        if name not in taken and engine_has(name):
            if backend.overrides:
                overrides = True
                warnings.append(
                    f"attnhost backend {backend.name!r} (plugin {backend.entry.plugin!r}) replaces vLLM's own "
                    f"{name!r} for MLA models, as ATTNHOST_VLLM_OVERRIDE asks"
                )
            else:
                renamed = to_engine_name(CLASH_PREFIX + backend.name) + MLA_SUFFIX
                warnings.append(
                    f"attnhost backend {backend.name!r} (plugin {backend.entry.plugin!r}) serves MLA models in vLLM "
                    f"as {renamed!r}: vLLM implements {name!r} itself and keeps it; set ATTNHOST_VLLM_OVERRIDE="
                    f"{backend.name} to replace vLLM's"
                )
                name = renamed
        other = owners.get(name)
        if (other is not None and other is not backend) or (not overrides and name not in taken and engine_has(name)):
            holder = f"attnhost backend {other.name!r}" if other is not None else "vLLM"
            warnings.append(
                f"attnhost backend {backend.name!r} (plugin {backend.entry.plugin!r}) gets no MLA name in vLLM: "
                f"{holder} already has {name!r}; rename one, or leave one out with ATTNHOST_PLUGINS"
            )
            continue
        exports.append(MLAExport(name, backend, overrides))
    return exports, warnings
