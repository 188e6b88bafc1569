"""TEST-ONLY host side: the models, the engine runs a check needs, and one driver process to run them.

Every engine runs in a child process (:mod:`.run_engine`) in its own session, on the kit's platform, so a
hang or crash stops there: a run past its time limit has its whole process group killed, and the host checks
that no process of it is left. The runs of one child share one import of vLLM (most of an engine's start on a
CPU), so the checks of a backend ask for their runs together (:func:`single_rank_runs`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnhost_vllm_engine_cpu import engine_env
from attnhost_vllm_engine_cpu import probe as probe_records

__all__ = [
    "BASE_ENGINE_ARGS",
    "IN_PROCESS",
    "NEW_TOKENS",
    "Models",
    "Outcome",
    "build_models",
    "generate_run",
    "left_running",
    "proposals",
    "run_engines",
    "speculative_run",
]

NEW_TOKENS = 8
SPEC_TOKENS = 3
BASE_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,  # no graph capture: attention metadata is built per batch on the host
    "dtype": "float32",
    "max_model_len": 256,
    "block_size": 32,  # CPU_ATTN (the reference runs) takes multiples of 32; attnhost backends take any
    "enable_prefix_caching": True,
    "max_num_batched_tokens": 32,  # less than the long prompts: chunked prefill, and chunks batched with decodes
    "max_num_seqs": 8,
    "seed": 0,
    "async_scheduling": False,  # each step scheduled after the last one's output: the same steps in every run
}
#: Per engine: the CPU KV cache (GiB) and no NUMA binding of OpenMP threads (the ranks share two cores here).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TIMEOUT = 900
#: For single-rank runs: vLLM's engine core in the driver's process (``InprocClient``), so an engine does not start
#: a process that imports vLLM again.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass(frozen=True)
class Models:
    """The tiny target, its draft and EAGLE head, the prompts and HF transformers' greedy ids for them."""

    target: Path
    draft: Path
    eagle: Path
    prompts: list[list[int]]
    second_pass: list[list[int]]
    hf_ids: list[list[int]]
    hf_second: list[list[int]]


def _prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Short, long and repetitive prompts (the last for the ngram proposer), and a second pass: the same prompts
    again and one sharing the longest one's first 64 tokens (prefix-cache hits, whole and partial)."""
    rng = random.Random(seed)
    words = [[rng.randrange(2, 1000) for _ in range(n)] for n in (4, 40, 75)]
    motif = [rng.randrange(2, 1000) for _ in range(5)]
    first = [[1, *w] for w in words] + [[1, *(motif * 6)]]
    second = [*first, [*first[2][:65], *(rng.randrange(2, 1000) for _ in range(9))]]
    return first, second


def build_models(root: Path) -> Models:
    from attnhost_vllm_engine_cpu import tiny_model as tm

    target, draft, eagle = root / "target", root / "draft", root / "eagle"
    tm.build_model(target)
    tm.build_draft_model(draft, target)
    tm.build_eagle_head(eagle, target)
    first, second = _prompts()
    hf = tm.hf_greedy(target, second, NEW_TOKENS)
    return Models(target, draft, eagle, first, second, hf[: len(first)], hf)


def generate_run(models: Models, backend: str, **engine_args: Any) -> dict[str, Any]:
    """``LLM.generate`` twice on one engine: the prompts, then the second pass (prefix-cached)."""
    args = {**BASE_ENGINE_ARGS, "attention_backend": backend, **engine_args}
    return {"engine_args": args, "passes": [models.prompts, models.second_pass], "max_tokens": NEW_TOKENS}


def speculative_run(models: Models, method: str, target: str, drafter: str | None) -> dict[str, Any]:
    """One pass with ``method`` (``ngram``, ``draft_model``, ``eagle``); ``drafter``: the speculative config's
    ``attention_backend`` (``None``: vLLM's choice, the target's)."""
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": SPEC_TOKENS}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=3)
    else:
        config["model"] = str(models.draft if method == "draft_model" else models.eagle)
    if drafter is not None:
        config["attention_backend"] = drafter
    args = {**BASE_ENGINE_ARGS, "attention_backend": target, "speculative_config": config}
    return {"engine_args": args, "passes": [models.prompts], "max_tokens": NEW_TOKENS}


@dataclass
class Outcome:
    """What one driver process returned: per run its result and its probe records; the process's exit."""

    results: list[dict[str, Any]]
    records: list[list[dict[str, Any]]]
    returncode: int | None
    seconds: float
    output: str
    timed_out: bool = False
    left_running: list[str] = field(default_factory=list)

    def result(self, index: int, what: str) -> dict[str, Any]:
        """Run ``index``'s result, or an ``AssertionError`` naming ``what`` and why it has none."""
        if index >= len(self.results):
            raise AssertionError(f"{what}: the engine process ended before this run ({self._ending()})")
        result = self.results[index]
        if "error" in result:
            raise AssertionError(f"{what}: the engine failed:\n{result['error']}")
        return result

    def _ending(self) -> str:
        if self.timed_out:
            return f"killed after {self.seconds:.0f} s"
        return f"exit {self.returncode}; last output:\n{self.output[-3000:]}"


def run_engines(
    model: Path, runs: list[dict[str, Any]], workdir: Path, timeout: float = TIMEOUT, **env: str
) -> Outcome:
    """Run ``runs`` one after another in one driver process; kill its process group past ``timeout`` seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out, probe = workdir / "spec.json", workdir / "out.json", workdir / "probe.jsonl"
    for path in (out, probe):
        path.unlink(missing_ok=True)
    spec.write_text(json.dumps({"model": str(model), "runs": runs}))
    environment = engine_env(str(probe), **{**ENGINE_ENV, **env})
    command = [sys.executable, "-m", "attnhost_vllm_engine_cpu.run_engine", str(spec), str(out)]
    start = time.monotonic()
    child = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    timed_out = False
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
    seconds = time.monotonic() - start
    left = left_running(child.pid)
    results = json.loads(out.read_text()) if out.exists() else []
    return Outcome(
        results, _split(probe_records.read(str(probe))), child.returncode, seconds, output or "", timed_out, left
    )


def left_running(session: int) -> list[str]:
    """Processes of the driver's session still alive a moment after it ended (vLLM's workers, its engine core)."""
    import psutil

    deadline = time.monotonic() + 10
    while True:
        left = []
        for proc in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [proc.info['name']])[:120]}")
            except (OSError, psutil.Error):
                continue
        if not left or time.monotonic() > deadline:
            if left:
                os.killpg(session, signal.SIGKILL)
            return left
        time.sleep(0.5)


def _split(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The probe's records by run (the driver writes a ``run`` record before each)."""
    runs: list[list[dict[str, Any]]] = []
    for record in records:
        if record["event"] == "run":
            runs.append([])
        elif runs:
            runs[-1].append(record)
    return runs


def proposals(records: list[dict[str, Any]]) -> list[list[list[int]]]:
    """The drafts vLLM's proposer returned, per request (in the order requests first appear), step by step.

    Per request, because which requests share a step is the scheduler's business: what the drafter must match
    is what it proposed for each request."""
    by_request: dict[str, list[list[int]]] = {}
    for record in records:
        if record["event"] == "proposals":
            discarded = record.get("discarded") or [False] * len(record["req_ids"])
            for request, drafts, dropped in zip(record["req_ids"], record["drafts"], discarded, strict=False):
                if not dropped:  # a chunked prefill's drafts are thrown away by vLLM: nothing to match
                    by_request.setdefault(request, []).append(list(drafts))
    return list(by_request.values())


def paths_seen(records: list[dict[str, Any]], backend: str) -> set[tuple[bool, str]]:
    """(draft?, forward mode) of every layer forward the attnhost adapter ran for ``backend``."""
    return {(bool(r["draft"]), r["mode"]) for r in records if r["event"] == "forward" and r["backend"] == backend}


def batches_seen(records: list[dict[str, Any]], backend: str) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "batch" and r["backend"] == backend]
