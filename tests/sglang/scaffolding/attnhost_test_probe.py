"""A general SGLang plugin that records what each model runner built and ran (test scaffolding).

Installed by tests/sglang as the distribution ``attnhost-test-probe`` with an
entry point in SGLang's ``sglang.srt.plugins`` group, so SGLang's own
``load_plugins()`` runs :func:`register` in every process, including the
spawned scheduler that owns the model runners. It uses SGLang's
``HookRegistry``: an AFTER hook on ``ModelRunner.init_attention_backends``
records the backend class each runner built, and hooks on the backends'
``forward_extend`` / ``forward_decode`` record that they ran. It changes no
argument and no result.

Records are JSON lines appended to the file named by
``ATTNHOST_TEST_PROBE_FILE`` (nothing is recorded when it is unset), one line
per runner and one per (backend object, forward kind) the first time it runs,
so a test in another process can read them while the engine is still up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from typing import Any

ENV = "ATTNHOST_TEST_PROBE_FILE"

#: ``(module, class)`` of the backends whose forward_extend/forward_decode are hooked: SGLang's own
#: torch_native and attnhost's adapter. A module that is not installed (attnhost without its SGLang
#: bridge) is left out; the runner record still names whatever backend was built.
FORWARD_TARGETS = (
    ("sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend"),
    ("attnhost.engines.sglang.adapter", "SGLangAdapterBackend"),
)

_lock = threading.Lock()
_seen: set[tuple[int, str]] = set()


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    record["pid"] = os.getpid()
    line = json.dumps(record, sort_keys=True) + "\n"
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(line)


def _qualified(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


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
            "decode_backend_class": None if decode_backend is None else _qualified(decode_backend),
            "prefill_attention_backend_str": getattr(runner, "prefill_attention_backend_str", None),
            "decode_attention_backend_str": getattr(runner, "decode_attention_backend_str", None),
            "backend_prefill_str": getattr(backend, "prefill_attention_backend_str", None),
            "backend_decode_str": getattr(backend, "decode_attention_backend_str", None),
        }
    )


def _forward_hook(kind: str) -> Any:
    def hook(result: object, backend: object, *args: object, **kwargs: object) -> None:
        key = (id(backend), kind)
        if key in _seen:
            return
        _seen.add(key)
        _write({"event": kind, "backend": id(backend), "backend_class": _qualified(backend)})

    hook.__qualname__ = f"probe_{kind}"
    return hook


def register() -> None:
    """SGLang general-plugin entry point: register the probe's hooks with SGLang's HookRegistry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",
        _after_init_attention_backends,
        HookType.AFTER,
    )
    for module, cls in FORWARD_TARGETS:
        if not _installed(module):
            continue
        for kind in ("forward_extend", "forward_decode"):
            HookRegistry.register(f"{module}.{cls}.{kind}", _forward_hook(kind), HookType.AFTER)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
