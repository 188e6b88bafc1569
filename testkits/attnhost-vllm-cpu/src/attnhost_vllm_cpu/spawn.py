"""Run a function in a process started the way vLLM starts its EngineCore and workers: ``multiprocessing`` spawn.

A spawned child is a fresh interpreter that unpickles its arguments (a
``VllmConfig`` among them) before anything else runs, so an attention backend
added to vLLM at run time must survive that unpickling on its own; that is
what the suite's spawn check and ``tests/vllm/test_spawn.py`` prove with
:mod:`.spawn_child`.
"""

from __future__ import annotations

import multiprocessing
import queue as queues
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SPAWN_TIMEOUT_S", "spawned"]

SPAWN_TIMEOUT_S = 240
"""How long the child may take to import vLLM and report (a loaded two-core machine needs tens of seconds)."""


def spawned(target: Callable[..., None], *args: Any) -> dict[str, Any]:
    """``target(*args, queue)`` in a spawned process; what it put on the queue (it must exit with status 0).

    A child that dies first (say, unpickling its arguments failed) is reported
    at once with its exit status, not after the timeout.
    """
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    result: dict[str, Any] | None = None
    try:
        while result is None and time.monotonic() < deadline:
            try:
                result = queue.get(timeout=1)
            except queues.Empty:
                if process.exitcode is not None:
                    break
    finally:
        process.join(timeout=60)
        if process.exitcode is None:
            process.kill()
    if result is None:
        raise AssertionError(
            f"the spawned process ({target.__module__}.{target.__qualname__}) reported nothing "
            f"(exit status {process.exitcode}, waited up to {SPAWN_TIMEOUT_S} s); its stderr above says why"
        )
    if process.exitcode != 0:
        raise AssertionError(
            f"the spawned process ({target.__module__}.{target.__qualname__}) exited with status {process.exitcode}"
        )
    return result
