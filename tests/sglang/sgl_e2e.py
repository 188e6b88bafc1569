"""What the real-SGLang tests share: the case's constants, the tiny model's record, the probe's checks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEW_TOKENS = 8

#: SGLang's own class for its torch_native, and attnhost's adapter for every attnhost backend.
SGLANG_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
ADAPTER = "attnhost.engines.sglang.adapter.SGLangAdapterBackend"


@dataclass(frozen=True)
class TinyModel:
    path: Path
    prompts: list[list[int]]
    hf_ids: list[list[int]]  # HF transformers' greedy continuation of each prompt


def read_probe(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_probe(records: list[dict[str, Any]], backend: str, expected_class: str, *, not_pid: int) -> None:
    """Every model runner the probe saw built *expected_class* for *backend* and ran its extend and decode."""
    runners = [r for r in records if r["event"] == "runner"]
    assert runners, f"the probe saw no model runner (records: {records})"
    for runner in runners:
        assert runner["pid"] != not_pid, "the probe ran in the driver, not in SGLang's spawned scheduler"
        assert runner["backend_class"] == expected_class, runner
        assert runner["prefill_attention_backend_str"] == runner["decode_attention_backend_str"] == backend, runner
        assert runner["backend_prefill_str"] == runner["backend_decode_str"] == backend, runner
        ran = {r["event"] for r in records if r["backend"] == runner["backend"] and r["pid"] == runner["pid"]}
        assert {"forward_extend", "forward_decode"} <= ran, f"{expected_class} ran only {sorted(ran)}"
