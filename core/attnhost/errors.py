"""The exceptions attnhost raises.

Every message is one sentence that names the culprit (plugin, distribution or
backend) and says how to get out; callers such as the CLI print ``str(exc)``
as-is, so no message may depend on a traceback to make sense.
"""

from __future__ import annotations

__all__ = [
    "AttnhostError",
    "BackendUnavailableError",
    "NoForwardContextError",
    "PlatformError",
    "PluginLoadError",
    "RegistryFrozenError",
    "UnknownBackendError",
]


class AttnhostError(Exception):
    """Base class of every error attnhost raises on purpose."""


class RegistryFrozenError(AttnhostError):
    """A backend or plugin was registered after the first ``ServerArgs`` was built.

    SGLang silently ignored such late registrations; here they are an error
    because choices that argument parsing has already validated against must
    not change underneath it.
    """


class UnknownBackendError(AttnhostError, ValueError):
    """A backend name that no installed plugin registered."""


class BackendUnavailableError(AttnhostError, RuntimeError):
    """A known backend that cannot be built here (declared only, wrong platform, missing module)."""


class PlatformError(AttnhostError, ValueError):
    """An unknown platform name (from ``ATTNHOST_PLATFORM`` or ``--platform``)."""


class PluginLoadError(AttnhostError, RuntimeError):
    """One or more plugins failed to load while ``ATTNHOST_STRICT=1`` is set."""


class NoForwardContextError(AttnhostError, RuntimeError):
    """Attention was dispatched outside ``ModelRunner.forward_context()``."""
