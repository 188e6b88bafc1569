"""TEST-ONLY general vLLM plugin: which forward paths attnhost's adapter saw, and what the drafter proposed.

Registered in vLLM's ``vllm.general_plugins`` group (entry point
``attnhost_test_probe``), so vLLM's own ``load_general_plugins()`` runs
:func:`register` in every engine process. It does nothing unless the kit's
platform is selected and :data:`~attnhost_vllm_engine_cpu.PROBE_ENV` names a
file. It changes no argument and no result; it wraps:

* the adapter's metadata builder (``AttnhostVLLMMetadataBuilder.build``): a
  ``batch`` record the first time a (backend, target or draft, forward mode,
  cached prefix, rows without a slot, persistent uniform batch) combination is
  planned;
* the adapter's impl (``AttnhostVLLMImpl.forward``): a ``forward`` record the
  first time a (backend, target or draft, forward mode) runs a layer;
* vLLM's model runner (``GPUModelRunner.propose_draft_token_ids``, which the CPU
  runner inherits): a ``proposals`` record per step with the draft token ids, the requests they are for, and which of
  them vLLM discards (requests still in a chunked prefill).

Records are JSON lines appended to the file, with the process id.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

from attnhost_vllm_engine_cpu import PROBE_ENV, platform_selected

_lock = threading.Lock()
_seen: set[tuple[Any, ...]] = set()
_draft_of: dict[int, bool] = {}
_installed = False


def write(record: dict[str, Any]) -> None:
    path = os.environ.get(PROBE_ENV)
    if not path:
        return
    record["pid"] = os.getpid()
    line = json.dumps(record, sort_keys=True) + "\n"
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(line)


def new_run(index: int) -> None:
    """Mark the start of the driver's run ``index``: later records are its own, and each (backend, mode) is recorded
    again, as it is in a fresh engine-core process (an engine core in the driver's process shares this module)."""
    with _lock:
        _seen.clear()
        _draft_of.clear()
    write({"event": "run", "run": index})


def _once(key: tuple[Any, ...]) -> bool:
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def _wrap_build(original: Any) -> Any:
    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = original(self, *args, **kwargs)
        batch = metadata.batch
        draft = bool(self._is_draft)
        _draft_of[id(metadata.backend)] = draft
        if batch is not None:
            name = self.identity.attnhost_name
            mode = batch.forward_mode.name
            prefix = any(p > 0 and e > 1 for p, e in zip(batch.prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True))
            rejected = metadata.written is not None
            uniform = self.graphs is not None and self.graphs.holds(batch)  # a batch vLLM's graphs could replay
            if _once(("batch", name, draft, mode, prefix, rejected, uniform)):
                write(
                    {
                        "event": "batch",
                        "backend": name,
                        "engine_name": self.identity.engine_name,
                        "draft": draft,
                        "mode": mode,
                        "extend_with_prefix": prefix,
                        "rows_without_slot": rejected,
                        "uniform": uniform,
                    }
                )
        return metadata

    return build


def _wrap_forward(original: Any) -> Any:
    @functools.wraps(original)
    def forward(
        self: Any,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        batch = getattr(attn_metadata, "batch", None)
        if batch is not None:
            name = self.identity.attnhost_name
            draft = _draft_of.get(id(attn_metadata.backend))
            mode = batch.forward_mode.name
            if _once(("forward", name, draft, mode)):
                write(
                    {
                        "event": "forward",
                        "backend": name,
                        "draft": draft,
                        "mode": mode,
                        "backend_class": type(attn_metadata.backend).__qualname__,
                        "kv_dtype": str(batch.kv_pool.dtype).removeprefix("torch."),
                        "page_size": batch.kv_pool.page_size,
                    }
                )
        return out

    return forward


def _wrap_propose(original: Any) -> Any:
    @functools.wraps(original)
    def propose_draft_token_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
        drafts = original(self, *args, **kwargs)
        ids = drafts.tolist() if hasattr(drafts, "tolist") else [list(d) for d in drafts]
        req_ids = list(self.input_batch.req_ids)
        # vLLM throws away what it samples, and drafts, for a request whose prompt is still being prefilled
        mask = getattr(self, "discard_request_mask", None)
        discarded = [bool(x) for x in mask.np[: len(req_ids)]] if mask is not None else [False] * len(req_ids)
        write({"event": "proposals", "drafts": ids, "req_ids": req_ids, "discarded": discarded})
        return drafts

    return propose_draft_token_ids


def register() -> None:
    """vLLM's general-plugin hook: install the wrappers once, when the kit's platform is selected and the probe on."""
    global _installed
    if _installed or not platform_selected() or not os.environ.get(PROBE_ENV):
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from attnhost.engines.vllm.adapter import AttnhostVLLMImpl, AttnhostVLLMMetadataBuilder

    AttnhostVLLMMetadataBuilder.build = _wrap_build(AttnhostVLLMMetadataBuilder.build)  # type: ignore[method-assign]
    AttnhostVLLMImpl.forward = _wrap_forward(AttnhostVLLMImpl.forward)  # type: ignore[method-assign]
    GPUModelRunner.propose_draft_token_ids = _wrap_propose(GPUModelRunner.propose_draft_token_ids)
    _installed = True


def read(path: str) -> list[dict[str, Any]]:
    """The records a probe file holds (none when no engine wrote it)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as records:
        return [json.loads(line) for line in records if line.strip()]
