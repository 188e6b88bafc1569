"""attnhost inside SGLang: every implemented, available attnhost backend becomes an SGLang backend.

attnhost's distribution declares ``attnhost = "attnhost.engines.sglang:register"``
in SGLang's general-plugin group ``sglang.srt.plugins``, so SGLang's own
``load_plugins()`` — which runs before CLI parsing in ``sglang serve`` and
``launch_server``, in ``Engine.__init__`` and again in every spawned
scheduler, detokenizer and DP-controller process — calls :func:`register`.
``SGLANG_PLUGINS`` and the ``ATTNHOST_*`` variables both apply.

Importing this package imports nothing of SGLang: only :func:`register`
does, and only SGLang calls it.
"""

from __future__ import annotations

__all__ = ["OVERRIDE_ENV", "register"]

from attnhost.engines import require_engine
from attnhost.settings import SGLANG_OVERRIDE_ENV as OVERRIDE_ENV


def register() -> None:
    """SGLang's general-plugin entry point: register attnhost's backends and hooks with SGLang."""
    require_engine("sglang", "SGLang")
    from attnhost.engines.sglang.bridge import install
    from attnhost.versions import warn_if_untested

    warn_if_untested("SGLang")

    install()
