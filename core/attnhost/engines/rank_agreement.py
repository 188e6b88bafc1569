"""An engine's start-up step on one rank, then the ranks' agreement check, whatever the step did.

Both engine bridges wrap one start-up step that every rank runs (SGLang's scheduler building its attention
backends, vLLM's worker reporting its KV layouts). A rank whose step failed must still join the collective
and send its error, and so must a rank that could not read what it resolved: a rank that skipped it would
leave the others waiting in it. The step's own error is raised after the collective, or chained below the
mismatch that names every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from attnhost.distributed import RunnerRow, check_ranks_agree
from attnhost.errors import RankCheckError, describe_exception

__all__ = ["step_then_agree"]

T = TypeVar("T")


def step_then_agree(step: Callable[[], T], group: Callable[[], Any], rows: Callable[[], tuple[RunnerRow, ...]]) -> T:
    """``step()``, then one agreement collective on ``group()`` (``None``: no collective) with ``rows()``."""
    try:
        result = step()
    except Exception as exc:  # joined to the collective first, so the other ranks do not wait for this one
        _agree(group(), rows, exc)
        raise
    _agree(group(), rows, None)
    return result


def _agree(cpu_group: Any, rows: Callable[[], tuple[RunnerRow, ...]], failure: Exception | None) -> None:
    if cpu_group is None:
        return
    resolved: tuple[RunnerRow, ...] = ()
    try:
        resolved = rows()
    except Exception as exc:  # never skip the collective for a reading fault
        failure = failure or exc
    error = None if failure is None else describe_exception(failure)
    try:
        check_ranks_agree(group=cpu_group, runners=resolved, error=error)
    except RankCheckError as exc:
        raise exc from failure  # this rank's own failure, if any, stays in the traceback
    if failure is not None:
        raise failure
