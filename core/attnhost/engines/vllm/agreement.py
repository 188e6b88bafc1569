"""Every rank of a vLLM tensor-parallel group runs the same attention plugins and backends, or the engine stops.

With ``tensor_parallel_size=N`` each rank is its own worker process that loads vLLM's general plugins, and
so attnhost's discovery, from its own environment, perhaps on another node. Ranks that disagree (an image
without the vendor package, another ``ATTNHOST_PLUGINS`` on one node) would build their attention layers on
different kernels: a hang in the first collective at best, wrong answers at worst.

Where the check runs, and why there. vLLM 0.33 has no hook registry and no plugin callback in its workers'
start-up (``vllm.general_plugins`` run before the worker exists; ``ParallelConfig.worker_extension_cls`` is
the user's one setting, may not override a worker method, and its ``init_worker_extension`` runs before the
model, so before any layer chose a backend). So one method is wrapped: :data:`TARGET`,
``WorkerBase.get_supported_kv_cache_layouts``. The engine core calls it exactly once per start, through
``collective_rpc`` on every worker of the engine (``EngineCore._initialize_kv_caches``), whatever the
executor (multiprocess, Ray, in-process, torchrun's external launcher), after ``init_device`` (vLLM's
process groups) and ``load_model`` (every attention layer resolved its backend with ``get_attn_backend``)
and before ``determine_available_memory`` (the profiling forward), ``initialize_from_config`` and
``compile_or_warm_up_model``. It is defined once, on the base of every worker class (GPU, CPU, XPU and the
out-of-tree ones inherit it; none in vLLM overrides it), and it already reads exactly what must agree: the
backends of the worker's attention layers. The wrapper keeps vLLM's signature and result, wraps once
however often :func:`install_agreement_check` runs, and checks once per worker.

What is compared, with :func:`attnhost.distributed.check_ranks_agree` on ``get_tp_group().cpu_group``
(vLLM's gloo group of the tensor-parallel ranks): the discovered plugins, the frozen registry, the platform,
and the backends the worker's attention layers resolved, by vLLM name with layer counts, vLLM's own backends
included (an attnhost adapter adds its attnhost name). A rank whose layers use a vLLM built-in still joins,
and a rank whose own call failed sends its error instead of skipping, so no rank leaves the others waiting.
One ``all_gather_object`` of a few hundred bytes; silent when all agree; nothing when the group has one rank.
A disagreement raises the same :class:`~attnhost.errors.RankMismatchError` on every rank, which vLLM reports
as that worker's failure and the engine does not start.

Not compared: pipeline stages with each other (their layers differ by design) and data-parallel replicas
(separate engines). A worker class that overrides ``get_supported_kv_cache_layouts`` without calling
vLLM's skips the check; its peers then fail with :class:`~attnhost.errors.RankCheckError` at the
CPU-group timeout (``--cpu-distributed-timeout-seconds``, else gloo's 30 minutes), not a silent hang.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from attnhost.distributed import RunnerRow
from attnhost.engines.rank_agreement import step_then_agree
from attnhost.engines.vllm.names import BACKENDS_MODULE

__all__ = ["LAYERS_LABEL", "TARGET", "install_agreement_check", "layer_rows"]

TARGET_MODULE = "vllm.v1.worker.worker_base"
#: Where the check runs: the worker method the engine core calls on every worker between model load and profiling.
TARGET = f"{TARGET_MODULE}.WorkerBase.get_supported_kv_cache_layouts"
#: The label of the one runner row a vLLM worker sends: all of its attention layers (target and draft).
LAYERS_LABEL = "vLLM worker's attention layers"

_WRAPPED = "__attnhost_agreement__"  # on the wrapper function: WorkerBase is wrapped already
_CHECKED = "_attnhost_ranks_agreed"  # on a worker: its ranks were compared already
_lock = threading.Lock()


def install_agreement_check() -> None:
    """Wrap :data:`TARGET` now if vLLM's worker module is imported, else as soon as it is (idempotent).

    The worker module costs seconds to import, so a process that never builds a worker (vLLM's front end,
    ``vllm serve --help``) is not made to import it; a process that does build one imports it first.
    """
    with _lock:
        module = sys.modules.get(TARGET_MODULE)
        if module is not None and hasattr(module, "WorkerBase"):
            _wrap(module)
        elif not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _WrapOnImport())


def _wrap(module: ModuleType) -> None:
    worker_base = module.WorkerBase
    original: Callable[[Any], list[str]] = worker_base.get_supported_kv_cache_layouts
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def get_supported_kv_cache_layouts(self: Any) -> list[str]:
        return _check_around(original, self)

    setattr(get_supported_kv_cache_layouts, _WRAPPED, True)
    worker_base.get_supported_kv_cache_layouts = get_supported_kv_cache_layouts


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when vLLM's worker module is found, wraps the method right after it executes."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != TARGET_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; the finders after it find the module as they would have
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None:
            return spec
        exec_module = loader.exec_module

        def exec_and_wrap(module: ModuleType) -> None:
            exec_module(module)
            _wrap(module)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]  # this spec's own loader object
        return spec


def _check_around(original: Callable[[Any], list[str]], worker: Any) -> list[str]:
    """vLLM's ``get_supported_kv_cache_layouts``, then (once per worker) one agreement collective."""

    def group() -> Any:
        if getattr(worker, _CHECKED, False):
            return None
        cpu_group = _tp_cpu_group()
        if cpu_group is not None:
            setattr(worker, _CHECKED, True)
        return cpu_group

    return step_then_agree(lambda: original(worker), group, lambda: layer_rows(worker.vllm_config))


def _tp_cpu_group() -> Any:
    """vLLM's CPU-side (gloo) tensor-parallel group when it has more than one rank, else ``None``."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    tp = get_tp_group()
    return tp.cpu_group if tp.world_size > 1 else None


def layer_rows(vllm_config: Any) -> tuple[RunnerRow, ...]:
    """What this worker's attention layers resolved, as one row: each backend's vLLM name and layer count.

    For example ``CPU_ATTN (2 layers)`` or ``TORCH_NATIVE [attnhost torch_native] (2 layers)``; the same
    text stands in the prefill and decode places, since a vLLM layer uses one backend for both. An
    attention-free model has no row.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    counts = Counter(_backend_label(layer.get_attn_backend()) for layer in layers.values())
    if not counts:
        return ()
    summary = ", ".join(f"{name} ({n} layer{'' if n == 1 else 's'})" for name, n in sorted(counts.items()))
    return ((LAYERS_LABEL, summary, summary, None),)


def _backend_label(backend: Any) -> str:
    name = str(backend.get_name())
    identity = getattr(backend, "identity", None) if backend.__module__ == BACKENDS_MODULE else None
    attnhost_name = getattr(identity, "attnhost_name", None)
    return name if attnhost_name is None else f"{name} [attnhost {attnhost_name}]"
