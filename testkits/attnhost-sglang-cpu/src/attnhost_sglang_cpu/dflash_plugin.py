"""TEST-ONLY general SGLang plugin: what SGLang's DFLASH worker needs on this CPU, and what a test reads of it.

Registered in SGLang's ``sglang.srt.plugins`` group (entry point
``attnhost_test_dflash``); :func:`register` returns at once unless the test
platform is selected (``SGLANG_PLATFORM=attnhost_test_cpu``). Through SGLang's
own ``HookRegistry`` it adds two pieces of scaffolding, both scoped to DFLASH:

* ``DFlashWorkerV2.forward_batch_generation`` calls
  ``seq_lens.record_stream(...)``, which a CPU tensor refuses ("unknown
  parameter type"): once a DFLASH worker is built, ``record_stream`` on a CPU
  tensor does nothing (a CPU tensor has no stream to outlive);
* ``ModelRunner._extend_forward_kwargs`` hands the model
  ``input_embeds.bfloat16()``, which the float32 draft refuses: for a DFLASH
  batch the model gets the batch's own ``input_embeds`` when they already have
  the runner's dtype (no round trip through bfloat16, so no precision lost).

With ``ATTNHOST_TEST_PROBE_FILE`` set it also records, as JSON lines in that
file: every DFLASH verify block the target ran (``dflash_verify``: per row the
committed length and the block's token ids, the draft's proposals after the
bonus token) and every call of SGLang's draft-backend resolver
(``draft_resolver``: the caller, what was named, what it returned).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from attnhost_sglang_cpu import PROBE_ENV, platform_selected

WORKER = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"
RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
RESOLVER = "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend"

_lock = threading.Lock()


def register() -> None:
    """SGLang general-plugin entry point: install the DFLASH scaffolding (and recorders) on the test platform."""
    if not platform_selected():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{WORKER}.__init__", _around_worker_init, HookType.AROUND)
    HookRegistry.register(f"{RUNNER}._extend_forward_kwargs", _keep_input_embeds, HookType.AFTER)
    if os.environ.get(PROBE_ENV):
        HookRegistry.register(f"{RUNNER}.forward", _record_verify, HookType.AFTER)
        HookRegistry.register(RESOLVER, _record_resolver, HookType.AFTER)


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    record["pid"] = os.getpid()
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record, sort_keys=True) + "\n")


def _around_worker_init(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    _cpu_record_stream_is_a_no_op()
    return original(worker, *args, **kwargs)


def _cpu_record_stream_is_a_no_op() -> None:
    import torch

    current = torch.Tensor.record_stream
    if getattr(current, "attnhost_test_cpu", False):
        return

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == "cpu":
            return  # no stream can free a CPU tensor early: nothing to record
        current(tensor, stream)

    record_stream.attnhost_test_cpu = True  # type: ignore[attr-defined]
    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]


def _is_dflash(forward_batch: Any) -> bool:
    algorithm = getattr(forward_batch, "spec_algorithm", None)
    return bool(algorithm is not None and algorithm.is_dflash())


def _keep_input_embeds(result: dict[str, Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    forward_batch = kwargs.get("forward_batch", args[0] if args else None)
    embeds = getattr(forward_batch, "input_embeds", None)
    if embeds is None or "input_embeds" not in result or not _is_dflash(forward_batch):
        return result
    if embeds.dtype == getattr(runner, "dtype", None):
        result["input_embeds"] = embeds
    return result


def _record_verify(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    forward_batch = kwargs.get("forward_batch", args[0] if args else None)
    if forward_batch is None or getattr(runner, "is_draft_worker", False) or not _is_dflash(forward_batch):
        return result
    if not forward_batch.forward_mode.is_target_verify():
        return result
    bs = int(forward_batch.batch_size)
    ids = forward_batch.input_ids.view(bs, -1).tolist()
    lens = forward_batch.seq_lens.tolist()
    _write({"event": "dflash_verify", "rows": [[int(n), row] for n, row in zip(lens, ids, strict=True)]})
    return result


def _record_resolver(answer: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.runtime_context import attention_backends, get_spec

    named = get_spec().speculative_draft_attention_backend
    target = attention_backends()[0]
    _write(
        {
            "event": "draft_resolver",
            "algo_label": kwargs.get("algo_label"),
            "named": named,
            "target": target,
            "answer": answer,
        }
    )
    return answer


def verify_rows(records: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
    """Every verify row the probe recorded (``(committed length, block ids)``), in the order the target ran them."""
    return [(int(n), list(ids)) for r in records if r["event"] == "dflash_verify" for n, ids in r["rows"]]


def resolver_calls(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every recorded call of SGLang's draft-worker resolver: ``algo_label``, ``named``, ``target``, ``answer``."""
    return [r for r in records if r["event"] == "draft_resolver"]
