"""TEST-ONLY general SGLang plugin: which attention backend each model runner built, and which forward modes ran.

Registered in SGLang's ``sglang.srt.plugins`` group (entry point
``attnhost_test_probe``), so SGLang's own ``load_plugins()`` runs
:func:`register` in every process, including the spawned scheduler that owns
the model runners. It does nothing unless ``ATTNHOST_TEST_PROBE_FILE`` names a
file and the test platform is selected. It uses SGLang's ``HookRegistry`` and
changes no argument and no result:

* AFTER ``ModelRunner.init_attention_backends``: a ``runner`` record (target
  or draft, the backend class built, the backend-name stamps, the cache format
  of SGLang's pool and of the view attnhost's adapter hands its backend);
* AROUND ``ModelRunner.forward``: remembers which runner is running, so each
  backend record below says whether the target or the draft ran it;
* AFTER ``forward`` of SGLang's ``AttentionBackend`` base (which every backend
  that does not override it dispatches through) and ``forward_extend`` /
  ``forward_decode`` of the backends in :data:`FORWARD_TARGETS`: a ``forward``
  record per (runner, backend object, method, forward mode) the first time;
* AFTER ``init_forward_metadata`` of those backends and of SGLang's
  multi-step draft container: a ``metadata`` record per (backend object,
  forward mode), with the container's per-step children;
* AFTER the speculative draft worker's ``init_attention_backend``: a
  ``draft_backends`` record with the multi-step decode container the worker
  got from SGLang's ``DraftBackendFactory`` (whoever supplied it), its per-step
  children, and the draft-extend backend.

* AFTER ``CPUGraphRunner.capture_one_batch_size`` and ``prepare_replay`` (the
  test platform's graph variant): a ``graph_capture`` record per captured batch
  size and a ``graph_replay`` record per replayed step (the batch size SGLang
  asked for and the captured size it ran, padded when larger), with the
  runner's attention backend class.

More backend classes can be named in ``ATTNHOST_TEST_PROBE_TARGETS``
(comma-separated ``module:Class``): an attnhost backend class named there also
gets its MLA methods (``forward_mla_mha``, ``forward_mla_mqa``) hooked when it
has them, so a record says which MLA form of *that* backend's code ran, in
which forward mode and for which runner. Records are JSON lines appended to the
file, so a test in another process can read them while the engine is up.
"""

from __future__ import annotations

import contextvars
import importlib.util
import json
import os
import threading
from typing import Any

from attnhost_sglang_cpu import PROBE_ENV, platform_selected

ENV = PROBE_ENV
TARGETS_ENV = "ATTNHOST_TEST_PROBE_TARGETS"

#: ``(module, class)`` of the backends whose own methods are hooked. A module that is not installed
#: (attnhost without its SGLang bridge) is left out.
FORWARD_TARGETS = (
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend"),
    ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),
    ("attnhost.engines.sglang.adapter", "SGLangAdapterBackend"),
)
#: Containers planned once per draft round (``init_forward_metadata``) that hold one backend per draft step.
CONTAINER_TARGETS = (("sglang.srt.layers.attention.triton_backend", "TritonMultiStepDraftBackend"),)
#: The attnhost contract's MLA methods, hooked on the backend classes named in ``ATTNHOST_TEST_PROBE_TARGETS``.
MLA_METHODS = ("forward_mla_mha", "forward_mla_mqa")
BASE = ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend")
RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
DRAFT_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
CPU_GRAPH_RUNNER = "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner"

_lock = threading.Lock()
_seen: set[tuple[Any, ...]] = set()
_current_runner: contextvars.ContextVar[tuple[int, bool] | None] = contextvars.ContextVar(
    "attnhost_test_probe_runner", default=None
)


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    record["pid"] = os.getpid()
    line = json.dumps(record, sort_keys=True) + "\n"
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(line)


def _once(key: tuple[Any, ...]) -> bool:
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def _qualified(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _mode(forward_batch: Any) -> str | None:
    mode = getattr(forward_batch, "forward_mode", None)
    return None if mode is None else str(getattr(mode, "name", mode))


def _after_init_attention_backends(result: object, runner: Any, *args: object, **kwargs: object) -> None:
    backend = runner.attn_backend
    decode_backend = getattr(runner, "decode_attn_backend", None)
    _write(
        {
            "event": "runner",
            "runner": id(runner),
            "is_draft_worker": bool(getattr(runner, "is_draft_worker", False)),
            "backend": id(backend),
            "backend_class": _qualified(backend),
            "kv_pool_class": _qualified(getattr(runner, "token_to_kv_pool", None)),
            "kv_pool_format": _cache_format(getattr(runner, "token_to_kv_pool", None)),
            "attnhost_kv_format": _cache_format(getattr(backend, "_kv", None)),
            "decode_backend_class": None if decode_backend is None else _qualified(decode_backend),
            "prefill_attention_backend_str": getattr(runner, "prefill_attention_backend_str", None),
            "decode_attention_backend_str": getattr(runner, "decode_attention_backend_str", None),
            "backend_prefill_str": getattr(backend, "prefill_attention_backend_str", None),
            "backend_decode_str": getattr(backend, "decode_attention_backend_str", None),
        }
    )


def _cache_format(cache: object) -> dict[str, Any] | None:
    """A cache's dtype and page size (SGLang's pool, or the view attnhost's adapter hands its backend)."""
    if cache is None or not hasattr(cache, "page_size"):
        return None
    return {"dtype": str(getattr(cache, "dtype", None)), "page_size": int(cache.page_size)}


def _around_runner_forward(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    token = _current_runner.set((id(runner), bool(getattr(runner, "is_draft_worker", False))))
    try:
        return original(runner, *args, **kwargs)
    finally:
        _current_runner.reset(token)


def _forward_hook(method: str) -> Any:
    def hook(result: object, backend: object, *args: Any, **kwargs: Any) -> None:
        forward_batch = kwargs.get("forward_batch", args[4] if len(args) > 4 else None)
        current = _current_runner.get()
        runner, is_draft = current if current is not None else (None, None)
        mode = _mode(forward_batch)
        if _once(("forward", runner, id(backend), method, mode)):
            _write(
                {
                    "event": "forward",
                    "method": method,
                    "mode": mode,
                    "runner": runner,
                    "is_draft_worker": is_draft,
                    "backend": id(backend),
                    "backend_class": _qualified(backend),
                }
            )

    hook.__qualname__ = f"probe_{method}"
    return hook


def _after_init_forward_metadata(result: object, backend: Any, *args: Any, **kwargs: Any) -> None:
    forward_batch = kwargs.get("forward_batch", args[0] if args else None)
    mode = _mode(forward_batch)
    if not _once(("metadata", id(backend), mode)):
        return
    children = getattr(backend, "attn_backends", None)
    current = _current_runner.get()
    _write(
        {
            "event": "metadata",
            "mode": mode,
            "runner": None if current is None else current[0],
            "backend": id(backend),
            "backend_class": _qualified(backend),
            "children": None if children is None else [[id(c), _qualified(c)] for c in children],
        }
    )


def _described(backend: Any) -> dict[str, Any] | None:
    if backend is None:
        return None
    children = getattr(backend, "attn_backends", None)
    return {
        "backend": id(backend),
        "backend_class": _qualified(backend),
        "stamp": getattr(backend, "prefill_attention_backend_str", None),
        "children": None if children is None else [[id(c), _qualified(c)] for c in children],
    }


def _after_draft_init_attention_backend(result: object, worker: Any, *args: Any, **kwargs: Any) -> None:
    runner = getattr(worker, "draft_runner", None)
    _write(
        {
            "event": "draft_backends",
            "runner": None if runner is None else id(runner),
            "decode": _described(getattr(worker, "draft_attn_backend", None)),
            "draft_extend": _described(getattr(worker, "draft_extend_attn_backend", None)),
        }
    )


def _after_graph_capture(result: object, graph_runner: Any, *args: Any, **kwargs: Any) -> None:
    bs = kwargs.get("bs", args[0] if args else None)
    backend = graph_runner.model_runner.attn_backend
    _write({"event": "graph_capture", "bs": bs, "backend_class": _qualified(backend)})


def _after_graph_replay(result: Any, graph_runner: Any, *args: Any, **kwargs: Any) -> None:
    forward_batch = kwargs.get("forward_batch", args[0] if args else None)
    backend = graph_runner.model_runner.attn_backend
    _write(
        {
            "event": "graph_replay",
            "asked_bs": getattr(forward_batch, "batch_size", None),
            "ran_bs": getattr(result, "batch_size", None),
            "backend_class": _qualified(backend),
        }
    )


def _targets(defaults: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    named = [t.strip().partition(":") for t in os.environ.get(TARGETS_ENV, "").split(",") if ":" in t]
    return [(m, c) for m, c in [*defaults, *((m, c) for m, _, c in named)] if _installed(m)]


def register() -> None:
    """SGLang general-plugin entry point: register the probe's hooks with SGLang's HookRegistry."""
    if not os.environ.get(ENV) or not platform_selected():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{RUNNER}.init_attention_backends", _after_init_attention_backends, HookType.AFTER)
    HookRegistry.register(f"{RUNNER}.forward", _around_runner_forward, HookType.AROUND)
    HookRegistry.register(f"{BASE[0]}.{BASE[1]}.forward", _forward_hook("forward"), HookType.AFTER)
    HookRegistry.register(f"{DRAFT_WORKER}.init_attention_backend", _after_draft_init_attention_backend, HookType.AFTER)
    for module, cls in _targets(FORWARD_TARGETS):
        for method in ("forward_extend", "forward_decode"):
            HookRegistry.register(f"{module}.{cls}.{method}", _forward_hook(method), HookType.AFTER)
        HookRegistry.register(f"{module}.{cls}.init_forward_metadata", _after_init_forward_metadata, HookType.AFTER)
    for module, cls in _targets(()):
        for method in MLA_METHODS:
            if _has(module, cls, method):
                HookRegistry.register(f"{module}.{cls}.{method}", _forward_hook(method), HookType.AFTER)
    for module, cls in _targets(CONTAINER_TARGETS):
        HookRegistry.register(f"{module}.{cls}.init_forward_metadata", _after_init_forward_metadata, HookType.AFTER)
    HookRegistry.register(f"{CPU_GRAPH_RUNNER}.capture_one_batch_size", _after_graph_capture, HookType.AFTER)
    HookRegistry.register(f"{CPU_GRAPH_RUNNER}.prepare_replay", _after_graph_replay, HookType.AFTER)


def _has(module: str, cls: str, method: str) -> bool:
    import pkgutil

    try:
        return callable(getattr(pkgutil.resolve_name(f"{module}:{cls}"), method, None))
    except Exception:  # not importable here: nothing to hook
        return False


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
