"""Whether a backend can run here, and if not, why — decided without importing it, so that ``attnhost list`` and
``ModelRunner``'s refusal give the same reason."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from attnhost.errors import printable
from attnhost.platform import TORCH_HINT, module_installed

if TYPE_CHECKING:
    from attnhost.registry import BackendEntry

__all__ = ["Availability", "check_availability"]


class Availability(NamedTuple):
    """Whether a backend runs here and, if not, the one-line reason shown to users."""

    available: bool
    reason: str | None = None
    summary: str | None = None
    """The reason without the per-backend detail, so a table can group the rows that share it."""

    @property
    def short(self) -> str | None:
        return self.summary or self.reason


def check_availability(entry: BackendEntry, platform: str) -> Availability:
    """Available means: implemented, meant for ``platform``, and its modules importable."""
    spec = entry.spec
    if not spec.implemented:
        # missing is a plugin implementing it, not the kernels' distribution (torch is here, flex_attention is not)
        summary = "declared only: no installed plugin implements it"
        builds_on = f" (a plugin would build it on {printable(spec.provided_by)})" if spec.provided_by else ""
        return Availability(False, summary + builds_on, summary)
    if spec.provided_by:
        fix = f"pip install {printable(spec.provided_by)}"
    elif entry.distribution:
        fix = f"reinstall {printable(entry.distribution)}"
    else:
        fix = "install the package that provides it"
    if isinstance(spec.factory, str) and not module_installed(spec.factory_module or ""):
        # a typo in the factory, or a module the wheel forgot: platform-independent, so it comes first
        return Availability(False, f"factory module {spec.factory_module!r} not found ({fix}, or fix the factory)")
    if spec.platforms and platform not in spec.platforms:
        return Availability(False, f"runs on {printable(', '.join(spec.platforms))}, not {platform}")
    missing = [module for module in spec.requires if not module_installed(module)]
    if not missing:
        return Availability(True)
    if missing[0] == "torch":  # whoever's backend it is, torch is installed one way: the advice that avoids CUDA
        return Availability(False, f"module 'torch' is not installed: {TORCH_HINT}")
    return Availability(False, f"module {missing[0]!r} is not installed ({fix})")
