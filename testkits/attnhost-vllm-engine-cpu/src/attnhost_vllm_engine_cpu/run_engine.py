"""TEST-ONLY driver, run as ``python -m attnhost_vllm_engine_cpu.run_engine SPEC OUT`` in an engine's own process.

``SPEC`` (JSON): ``model``, ``engine_args`` (``vllm.LLM``'s keyword arguments), ``passes`` (lists of prompts as
token ids, each pass one ``LLM.generate`` call on the same engine, so a later pass may hit the prefix cache) and
``max_tokens``. ``OUT`` (JSON): the greedy ids of every pass, the engine's speculative and prefix-cache counters, or
``error`` with the traceback. One engine per process: nothing of it outlives the process.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

COUNTERS = ("vllm:spec_decode", "vllm:prefix_cache")
"""The metric families reported back (speculative drafts and acceptances, prefix-cache queries and hits)."""


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], tokenizer=spec["model"], disable_log_stats=False, **spec["engine_args"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    passes = []
    for prompts in spec["passes"]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        passes.append([list(o.outputs[0].token_ids) for o in outputs])
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(COUNTERS) and hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0) + float(metric.value)
    return {"passes": passes, "counters": counters}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    try:
        result = generate(spec)
    except BaseException as exc:  # the host reads the reason from OUT, whatever stopped the engine
        result = {"error": "".join(traceback.format_exception(exc))}
    Path(argv[2]).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
