"""Run real ``sglang.Engine`` generations, one engine per backend, and print their greedy ids (test scaffolding).

``python run_engine.py JOB_JSON`` where the job is ``{"model": DIR, "prompts":
[[ids]], "new_tokens": N, "runs": [{"backend": NAME, "probe": FILE, "name": ID, "engine_args": {...}}, ...]}``
(``name`` and ``engine_args``, extra ``sglang.Engine`` keywords such as ``tp_size``, are optional)
prints one JSON line per run: ``{"backend", "name", "output_ids", "children_left",
"driver_pid"}`` or ``{"backend", "name", "error", "driver_pid"}``. Engines run one after another in this process,
as a user's script would run them; each spawns its own scheduler, which
inherits ``ATTNHOST_TEST_PROBE_FILE`` (set per run) for the probe.

The torchvision shim is installed at module level, before SGLang is
imported, because SGLang's spawned children re-import this file as
``__mp_main__`` and need it too. Running in its own interpreter keeps SGLang's
process-wide state (signal handlers, multiprocessing start method, plugin-load
guard, platform singleton) out of pytest.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import shim

shim.install()

PROBE_ENV = "ATTNHOST_TEST_PROBE_FILE"


def run_one(
    model: str, prompts: list[list[int]], new_tokens: int, backend: str, engine_args: dict[str, Any]
) -> dict[str, Any]:
    import psutil
    import sglang as sgl

    engine = sgl.Engine(
        model_path=model,
        device="cpu",
        attention_backend=backend,
        max_total_tokens=4096,
        dtype="float32",
        random_seed=0,
        log_level="error",
        **engine_args,
    )
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    return {
        "backend": backend,
        "output_ids": [out["output_ids"] for out in outs],
        "children_left": [" ".join(p.cmdline())[:120] for p in left],
    }


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    for run in job["runs"]:
        os.environ[PROBE_ENV] = run["probe"]
        try:
            args = run.get("engine_args", {})
            result = run_one(job["model"], job["prompts"], job["new_tokens"], run["backend"], args)
        except Exception:
            result = {"backend": run["backend"], "error": traceback.format_exc(limit=8)}
        result["driver_pid"] = os.getpid()
        result["name"] = run.get("name", run["backend"])
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
