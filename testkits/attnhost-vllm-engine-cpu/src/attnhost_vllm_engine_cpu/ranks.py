"""TEST-ONLY general vLLM plugin: environment settings for one tensor-parallel rank only.

A real deployment's ranks can disagree: one node's image lacks the vendor
package, or sets another ``ATTNHOST_PLUGINS``. vLLM's multiprocess executor
starts every worker with the engine's environment, so a test of that case
needs one rank started differently. When :data:`RANK_ENV` holds a JSON object
``{"RANK": {"NAME": "VALUE", ...}}`` (and the kit's platform is selected),
:func:`register` wraps ``WorkerProc.make_worker_process`` so that the worker
of rank RANK starts with those settings; no other rank, argument or result
changes.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from attnhost_vllm_engine_cpu import platform_selected

RANK_ENV = "ATTNHOST_TEST_RANK_ENV"
_installed = False


def register() -> None:
    global _installed
    settings = os.environ.get(RANK_ENV)
    if _installed or not settings or not platform_selected():
        return
    per_rank: dict[str, dict[str, str]] = json.loads(settings)
    from vllm.v1.executor.multiproc_executor import WorkerProc

    original = WorkerProc.make_worker_process

    @functools.wraps(original)
    def make_worker_process(*args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank", args[2] if len(args) > 2 else None)
        extra = per_rank.get(str(rank), {})
        saved = {name: os.environ.get(name) for name in extra}
        os.environ.update(extra)
        try:  # the worker process starts here and inherits this environment
            return original(*args, **kwargs)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    WorkerProc.make_worker_process = staticmethod(make_worker_process)
    _installed = True
