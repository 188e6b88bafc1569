"""TEST-ONLY driver, run as ``python -m attnhost_vllm_engine_cpu.run_engine SPEC OUT`` in a process of its own.

``SPEC`` (JSON): ``model`` and ``runs``, each with ``engine_args`` (``vllm.LLM``'s keyword arguments), optionally
its own ``model`` (engines of several models then share the one import of vLLM), ``passes`` (lists of prompts as
token ids; each pass is one ``LLM.generate`` call on the run's engine, so a later pass may hit the prefix cache),
and ``max_tokens`` (one number for every pass, or a list with one per pass). The runs' engines are built one
after another in this process (importing vLLM once is most of an engine's start here), each shut down before the
next. ``OUT`` (JSON): per run, the greedy ids and seconds of every pass, the engine's speculative and prefix-cache
counters and the seconds it took, or ``error`` with the traceback. A run's error does not stop the next run.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from attnhost_vllm_engine_cpu import probe

COUNTERS = ("vllm:spec_decode", "vllm:prefix_cache")
"""The metric families reported back (speculative drafts and acceptances, prefix-cache queries and hits)."""


def generate(model: str, run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, tokenizer=model, disable_log_stats=False, **run["engine_args"])
    try:
        limits = run["max_tokens"]
        if isinstance(limits, int):
            limits = [limits] * len(run["passes"])
        passes, seconds = [], []
        for prompts, limit in zip(run["passes"], limits, strict=True):
            params = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True)
            start = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            passes.append([list(o.outputs[0].token_ids) for o in outputs])
        counters: dict[str, float] = {}
        for metric in llm.get_metrics():
            if metric.name.startswith(COUNTERS) and hasattr(metric, "value"):
                counters[metric.name] = counters.get(metric.name, 0) + float(metric.value)
    finally:
        shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
        _release()
    return {"passes": passes, "pass_seconds": seconds, "counters": counters}


def _release() -> None:
    """vLLM's process-wide state of an engine (its process groups), so that the next engine builds its own."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    results = []
    for index, run in enumerate(spec["runs"]):
        probe.new_run(index)  # the probe's records after this one are this run's
        start = time.monotonic()
        try:
            result = generate(run.get("model", spec["model"]), run)
        except BaseException as exc:  # the host reads the reason from OUT, whatever stopped the engine
            result = {"error": "".join(traceback.format_exception(exc))}
        result["seconds"] = round(time.monotonic() - start, 1)
        results.append(result)
        Path(argv[2]).write_text(json.dumps(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
