"""TEST-ONLY: run real ``sglang.Engine`` generations one after another and print each one's greedy ids.

``python -m attnhost_sglang_cpu.run_engine JOB_JSON`` runs one job; ``python -m attnhost_sglang_cpu.run_engine -``
runs each job read from stdin, one JSON line each, until stdin closes (one driver kept for many jobs: each driver
start imports SGLang, seconds here). A job is
``{"model": DIR, "prompts": [[ids]], "new_tokens": N, "runs": [RUN, ...]}`` and
each run is ``{"name": ID, "backend": NAME, "probe": FILE, "engine_args": {...},
"env": {...}, "model": DIR, "prompts": [[ids]], "passes": N, "logprobs": BOOL}`` (``name`` defaults to the backend;
``model`` and ``prompts`` to the job's; ``passes`` generations in one engine, 1 by default; ``logprobs``: also
report each generated token's log-probability, which shows a numeric change greedy ids may hide; ``engine_args``
are further ``sglang.Engine`` keyword arguments, such as the speculative ones of
:func:`speculative_args`; ``env`` is set for that run only). It prints one
JSON line per run: ``{"name", "backend", "output_ids", "meta_info",
"seconds", "children_left", "driver_pid"}`` or ``{"name", "backend", "error",
"driver_pid"}``. ``meta_info`` keeps SGLang's speculative counters
(``spec_verify_ct``, ``spec_accept_length``, ...) per prompt.

Engines run one after another in this process, as a user's script would run
them; each spawns its own scheduler, which inherits ``ATTNHOST_TEST_PROBE_FILE``
(set per run) for the probe. The torchvision shim is installed at module
level, before SGLang is imported, because SGLang's spawned children re-import
this module as ``__mp_main__`` and need it too. Running in its own
interpreter keeps SGLang's process-wide state (signal handlers,
multiprocessing start method, plugin-load guard, platform singleton) out of
the caller's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from attnhost_sglang_cpu import PROBE_ENV, shim

shim.install()

#: What every engine here gets unless a run overrides it: the CPU, float32, seeded, quiet.
ENGINE_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "max_total_tokens": 4096,
    "dtype": "float32",
    "random_seed": 0,
    "log_level": "error",
}
META_KEYS = (
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "completion_tokens",
    "cached_tokens",
)


def speculative_args(
    draft_model: str,
    *,
    algorithm: str = "STANDALONE",
    topk: int = 1,
    num_steps: int = 3,
    num_draft_tokens: int = 4,
    draft_backend: str | None = None,
) -> dict[str, Any]:
    """The ``sglang.Engine`` keyword arguments of one speculative run (CUDA graphs off: the CPU has none)."""
    args: dict[str, Any] = {
        "speculative_algorithm": algorithm,
        "speculative_draft_model_path": draft_model,
        "speculative_num_steps": num_steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": num_draft_tokens,
        "disable_cuda_graph": True,
    }
    if draft_backend is not None:
        args["speculative_draft_attention_backend"] = draft_backend
    return args


def run_one(
    model: str,
    prompts: list[list[int]],
    new_tokens: int,
    backend: str,
    passes: int = 1,
    logprobs: bool = False,
    **engine_args: Any,
) -> dict[str, Any]:
    """One engine, *passes* generations of the same prompts (a later pass finds their prefixes in the radix
    cache); ``output_ids`` / ``meta_info`` (and with *logprobs* ``logprobs``: per prompt, each generated token's
    log-probability) are the first pass's, ``later_passes`` the others'."""
    import psutil
    import sglang as sgl

    start = time.monotonic()
    engine = sgl.Engine(model_path=model, attention_backend=backend, **{**ENGINE_DEFAULTS, **engine_args})
    results = []
    try:
        for _ in range(passes):
            outs = engine.generate(
                input_ids=prompts,
                sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
                return_logprob=logprobs,
            )
            results.append(
                {
                    "output_ids": [out["output_ids"] for out in outs],
                    "meta_info": [{k: out["meta_info"][k] for k in META_KEYS if k in out["meta_info"]} for out in outs],
                }
            )
            if logprobs:  # SGLang's (logprob, token id, text) per generated token
                results[-1]["logprobs"] = [[e[0] for e in out["meta_info"]["output_token_logprobs"]] for out in outs]
    finally:
        engine.shutdown()
    seconds = time.monotonic() - start
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    return {
        **results[0],
        "later_passes": results[1:],
        "seconds": round(seconds, 2),
        "children_left": [" ".join(p.cmdline())[:120] for p in left],
    }


def main(argv: list[str]) -> int:
    base_env = dict(os.environ)
    if argv == ["-"]:
        for line in sys.stdin:
            if line.strip():
                run_job(json.loads(line), base_env)
    else:
        run_job(json.loads(argv[0]), base_env)
    return 0


def run_job(job: dict[str, Any], base_env: dict[str, str]) -> None:
    """Run each of the job's runs, one engine after another, each in *base_env* plus its own ``env``, and print
    one JSON line per run."""
    for run in job["runs"]:
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(run.get("env", {}))
        os.environ[PROBE_ENV] = run.get("probe", "")
        result: dict[str, Any] = {"name": run.get("name", run["backend"]), "backend": run["backend"]}
        try:
            result |= run_one(
                run.get("model", job["model"]),
                run.get("prompts", job["prompts"]),
                job["new_tokens"],
                run["backend"],
                run.get("passes", 1),
                run.get("logprobs", False),
                **run.get("engine_args", {}),
            )
        except Exception:
            result["error"] = traceback.format_exc(limit=8)
        result["driver_pid"] = os.getpid()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
