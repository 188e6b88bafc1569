"""The pluggy hook specifications: the whole surface a plugin can implement.

Importing this module imports pluggy, so ``attnhost/__init__`` exposes
``hookimpl`` lazily: a process that never loads plugins never pays for it.
The spec marker stays private: plugins implement hooks, they do not add them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from attnhost.spec import BackendSpec

__all__ = ["HOOK_NAMES", "PROJECT_NAME", "AttnhostHookSpecs", "hookimpl"]

PROJECT_NAME = "attnhost"

_hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class AttnhostHookSpecs:
    """Hooks a plugin may implement (decorate module functions with ``@attnhost.hookimpl``)."""

    @_hookspec
    def attnhost_attention_backends(self) -> Sequence[BackendSpec]:
        """Return the attention backends this plugin provides (all usable by target models)."""
        raise NotImplementedError

    @_hookspec
    def attnhost_draft_attention_backends(self) -> Sequence[str]:
        """Return the names (of any plugin's backends) that speculative draft workers may use."""
        raise NotImplementedError

    @_hookspec(firstresult=True)
    def attnhost_draft_fallback(self, platform: str) -> str | None:
        """Return the draft backend to fall back to on ``platform``, or None to let others answer.

        The built-in plugin answers last: ``triton`` on ROCm, ``flashinfer``
        elsewhere. A platform plugin answers first for its own platform.
        """
        raise NotImplementedError

    @_hookspec(firstresult=True)
    def attnhost_default_attention_backend(self, platform: str) -> str | None:
        """Return the target backend to use on ``platform`` when no flag names one, or None."""
        raise NotImplementedError


HOOK_NAMES: tuple[str, ...] = tuple(name for name in vars(AttnhostHookSpecs) if name.startswith("attnhost_"))
