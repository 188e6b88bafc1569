"""attnhost inside vLLM: every implemented, available attnhost backend becomes a vLLM attention backend.

attnhost's distribution declares ``attnhost = "attnhost.engines.vllm:register"``
in vLLM's general-plugin group ``vllm.general_plugins``, so vLLM's own
``load_general_plugins()`` — which runs in ``AsyncEngineArgs.add_cli_args``
(before the parser is built), ``EngineArgs.__post_init__``,
``EngineCore.__init__`` and ``WorkerWrapperBase.init_worker``, i.e. in every
process — calls :func:`register`. ``VLLM_PLUGINS`` and the ``ATTNHOST_*``
variables both apply. :func:`register` also installs the rank-agreement check
of tensor-parallel workers (:mod:`attnhost.engines.vllm.agreement`).

Importing this package imports nothing of vLLM (nor torch): only
:func:`register` does, and only vLLM calls it.
"""

from __future__ import annotations

__all__ = ["OVERRIDE_ENV", "register"]

from attnhost.engines import require_engine
from attnhost.settings import VLLM_OVERRIDE_ENV as OVERRIDE_ENV


def register() -> None:
    """vLLM's general-plugin entry point: register attnhost's backends and the workers' rank-agreement check."""
    require_engine("vllm", "vLLM")
    from attnhost.engines.vllm.agreement import install_agreement_check
    from attnhost.engines.vllm.bridge import install
    from attnhost.versions import warn_if_untested

    warn_if_untested("vLLM")

    install()
    install_agreement_check()
