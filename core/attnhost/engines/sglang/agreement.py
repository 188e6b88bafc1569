"""Every rank of an SGLang engine runs the same attention plugins and backends, or the engine does not start.

With ``--tp-size N`` (and pipeline or attention-data parallelism) each rank is its own scheduler process
that loads plugins from its own environment, on its own node. Ranks that disagree (a node whose image lacks
the vendor package, another ``ATTNHOST_PLUGINS`` on one rank, a plugin whose availability differs between
devices) would resolve different kernels: at best a hang in the first collective, at worst wrong answers.

So an AROUND hook (SGLang's ``HookRegistry``) on ``Scheduler.init_all_attention_backends`` runs, once per
engine start, :func:`attnhost.distributed.check_ranks_agree` on SGLang's CPU-side (gloo) WORLD group,
which holds every rank of the engine: tensor, pipeline and attention data parallel. That is after SGLang
set its process groups up and every model runner (target and draft) resolved and built its attention
backends, and before CUDA-graph capture or any forward. One ``all_gather_object`` of a few hundred bytes;
silent when all agree.

It runs whatever the ranks chose, SGLang's own backends included, and a rank whose backends failed to
build still joins (it sends its error instead), so no rank skips the collective and leaves the others
waiting. When the ranks differ, the same :class:`~attnhost.errors.RankMismatchError` is raised on every
rank, naming per differing rank what differs; SGLang's scheduler then stops the engine as for any failed
rank. A single-rank engine has nothing to compare and does no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnhost.distributed import RunnerRow
from attnhost.engines.rank_agreement import step_then_agree

__all__ = ["TARGET", "install_agreement_check", "runner_rows"]

#: Where the check runs: the scheduler's one step that builds every runner's attention backends.
TARGET = "sglang.srt.managers.scheduler.Scheduler.init_all_attention_backends"


def install_agreement_check() -> None:
    """Register the check with SGLang's HookRegistry (called once per process by the bridge)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _check_after_backends, HookType.AROUND)


def _check_after_backends(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``init_all_attention_backends``, then one agreement collective over the engine's ranks."""
    return step_then_agree(
        lambda: original(scheduler, *args, **kwargs), _world_cpu_group, lambda: runner_rows(scheduler)
    )


def _world_cpu_group() -> Any:
    """SGLang's CPU-side WORLD group when the engine has more than one rank, else ``None``."""
    from sglang.srt.distributed.parallel_state import get_world_group

    world = get_world_group()
    return world.cpu_group if world.world_size > 1 else None


def runner_rows(scheduler: Any) -> tuple[RunnerRow, ...]:
    """What each of the scheduler's model runners resolved: ``(label, prefill, decode, draft)`` names."""
    worker = scheduler.tp_worker
    runners = list(getattr(worker, "model_runner_list", None) or [worker.model_runner])
    draft_worker = getattr(scheduler, "draft_worker", None)
    if draft_worker is not None:
        runners += [r for r in getattr(draft_worker, "draft_runners", None) or () if r not in runners]
    rows: list[RunnerRow] = []
    for index, runner in enumerate(runners):
        label = f"{'draft' if getattr(runner, 'is_draft_worker', False) else 'target'} runner {index}"
        fields = ("prefill_attention_backend_str", "decode_attention_backend_str", "draft_attention_backend")
        prefill, decode, draft = (_name(getattr(runner, field, None)) for field in fields)
        rows.append((label, prefill, decode, draft))
    return tuple(rows)


def _name(value: object) -> str | None:
    return None if value is None else str(value)
