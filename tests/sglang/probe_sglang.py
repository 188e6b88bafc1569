"""Run in a fresh interpreter: load SGLang's plugins the way SGLang does, then report what happened as JSON.

Each SGLang process loads its plugins once (``load_plugins`` is guarded per
process), so every scenario of ``test_bridge.py`` runs here in its own
process, with its own environment and plugin distributions on
``PYTHONPATH``, exactly as ``sglang serve`` would start.

Usage: ``python probe_sglang.py SPEC_JSON`` where the spec may hold
``server_args`` (a list of argv lists, each prepared and resolved with
SGLang's own ``prepare_server_args`` / ``resolve_once`` and then given to
SGLang's draft resolver), ``late`` (try a late attnhost registration) and
``spawn`` (report what a spawned child registers).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import sys
from typing import Any

from attnhost_sglang_cpu import shim

# SGLang imports torchvision at module level (see the test kit's shim); the spawned child re-imports this file.
shim.install()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        cause = f" [{record.exc_info[1]}]" if record.exc_info else ""  # SGLang logs a plugin's error as exc_info
        self.records.append({"logger": record.name, "level": record.levelname, "message": record.getMessage() + cause})


def registration() -> dict[str, Any]:
    """Which SGLang names now build attnhost adapters, and the two choice lists."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    ours = sorted(name for name, factory in ATTENTION_BACKENDS.items() if factory.__module__.startswith("attnhost."))
    return {
        "attnhost_factories": ours,
        "all_backends": sorted(ATTENTION_BACKENDS),
        "choices": list(choices.ATTENTION_BACKEND_CHOICES),
        "draft_choices": list(choices.DRAFT_ATTENTION_BACKEND_CHOICES),
        "sglang_modules_before_load": None,
    }


def _child(queue: Any) -> None:
    from sglang.srt.plugins import load_plugins

    collect = _Collect()  # what a spawned scheduler or detokenizer would log
    logging.getLogger().addHandler(collect)
    logging.getLogger().setLevel(logging.INFO)
    load_plugins()
    queue.put({**registration(), "logs": [r for r in collect.records if r["logger"].startswith("attnhost")]})


def resolve(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.draft_worker_common import resolve_draft_worker_attention_backend

    args = prepare_server_args(argv)
    args.resolve_once()
    view = resolved_view(args)
    publish(args, role="scheduler")
    return {
        "attention_backend": view.attention_backend,
        "prefill_attention_backend": view.prefill_attention_backend,
        "decode_attention_backend": view.decode_attention_backend,
        "speculative_draft_attention_backend": view.speculative_draft_attention_backend,
        "cuda_graph_decode": str(view.cuda_graph_config.decode.backend),
        "cuda_graph_prefill": str(view.cuda_graph_config.prefill.backend),
        "draft_worker_backend": resolve_draft_worker_attention_backend(algo_label="EAGLE"),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    collect = _Collect()
    logging.getLogger().addHandler(collect)
    logging.getLogger().setLevel(logging.INFO)
    before = sorted(name for name in sys.modules if name == "sglang" or name.startswith("sglang."))
    import attnhost  # noqa: F401 - attnhost on its own imports nothing of SGLang

    attnhost_alone = sorted(name for name in sys.modules if name == "sglang" or name.startswith("sglang."))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out: dict[str, Any] = registration()
    out["sglang_modules_before_load"] = before
    out["sglang_modules_after_import_attnhost"] = attnhost_alone
    out["resolved"] = [resolve(argv) for argv in spec.get("server_args", [])]
    if spec.get("late"):
        import attnhost as ah

        try:
            ah.add_attention_backend_choices(["late_backend"])
            out["late"] = None
        except ah.RegistryFrozenError as exc:
            out["late"] = f"RegistryFrozenError: {exc}"
    if spec.get("spawn"):
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_child, args=(queue,))
        child.start()
        out["spawned"] = queue.get(timeout=240)
        child.join(60)
    out["logs"] = [r for r in collect.records if r["logger"].startswith("attnhost") or "attnhost" in r["message"]]
    print("PROBE-JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
