"""Target of the spawned process (:func:`attnhost_vllm_cpu.spawn.spawned`): it reports what it received, before any
plugin loads there. Its own module, so the child imports nothing of the suite or of pytest to find it."""

from __future__ import annotations

import pickle
from multiprocessing.queues import Queue
from typing import Any

__all__ = ["report"]


def report(config: Any, payloads: list[bytes], queue: Queue[Any]) -> None:
    """``config`` was unpickled by multiprocessing before this runs, as vLLM's EngineCore receives its VllmConfig.

    Then each pickled enum member in ``payloads`` is unpickled in turn; a
    failure is reported, not raised (the negative control expects one).
    """
    try:
        queue.put(_report(config, payloads))
    except Exception as exc:  # the parent reads the cause instead of waiting out its timeout
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _report(config: Any, payloads: list[bytes]) -> dict[str, Any]:
    import vllm.plugins

    loaded_before = vllm.plugins.plugins_loaded
    target = config.attention_config.backend
    # no speculative config: the draft is the target (the report's draft fields then repeat the target's)
    draft = config.speculative_config.attention_backend if config.speculative_config is not None else target
    target_cls, draft_cls = target.get_class(), draft.get_class()
    members = []
    for data in payloads:
        try:
            members.append(pickle.loads(data).name)
        except Exception as exc:
            members.append(f"{type(exc).__name__}: {exc}")
    return {
        "plugins_loaded_before": loaded_before,
        "target": target.name,
        "draft": draft.name,
        "target_cls": f"{target_cls.__module__}.{target_cls.__qualname__}",
        "draft_cls": f"{draft_cls.__module__}.{draft_cls.__qualname__}",
        "target_impl": target_cls.get_impl_cls().__qualname__,
        "identity": target_cls.identity.attnhost_name,
        "draft_identity": draft_cls.identity.attnhost_name,
        "members": members,
    }
