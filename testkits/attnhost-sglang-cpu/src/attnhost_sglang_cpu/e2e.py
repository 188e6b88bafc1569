"""TEST-ONLY: run engine jobs through the driver and read what the probe recorded.

:class:`EngineDriver` keeps :mod:`attnhost_sglang_cpu.run_engine` running in a fresh interpreter and process
group and hands it jobs, engine after engine; :func:`run_engines` runs one job in a driver of its own. A run whose
scheduler crashes takes SGLang's driver down with it (SGLang kills its process tree on a child's failure), so the
driver is started again for the runs after it; the crashed run reports the driver's exit and stderr.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from attnhost_sglang_cpu import driver_command, sglang_env
from attnhost_sglang_cpu.procs import Finished, describe, kill_group, wait_group_empty

#: SGLang's own class for its torch_native, and attnhost's adapter for every attnhost backend.
SGLANG_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
SGLANG_TRITON = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
ADAPTER = "attnhost.engines.sglang.adapter.SGLangAdapterBackend"
#: SGLang's hybrid sliding-window pool: the window layers' keys in a smaller pool of their own.
SGLANG_SWA_POOL = "sglang.srt.mem_cache.swa_memory_pool.SWAKVPool"
#: attnhost's adapter for a model runner of an MLA model (DeepSeek, Kimi).
MLA_ADAPTER = "attnhost.engines.sglang.mla.SGLangMLAAdapterBackend"


@dataclass(frozen=True)
class TinyModel:
    path: Path
    prompts: list[list[int]]
    hf_ids: list[list[int]]  # HF transformers' greedy continuation of each prompt


@dataclass(frozen=True)
class EngineRuns:
    drivers: list[Finished]  # one per driver start (more than one only when a crash ended a driver early)
    results: dict[str, dict[str, Any]]  # by run name
    probes: dict[str, Path]  # by run name


class EngineDriver:
    """One ``run_engine`` driver process kept for many jobs (each start imports SGLang, seconds here), in its own
    process group, started at its first job and again after a run that ended it. ``finished`` holds each driver
    process that ended, with what it printed and what it left behind."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._readers: list[threading.Thread] = []
        self.finished: list[Finished] = []

    def __enter__(self) -> EngineDriver:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def run(
        self,
        model: Path,
        prompts: list[list[int]],
        new_tokens: int,
        runs: Sequence[Mapping[str, Any]],
        probes_dir: Path,
        timeout: float = 540,
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Path]]:
        """Run each of *runs* (``{"name", "backend", "engine_args", "env"}``, see run_engine) and return each one's
        result and probe file by name. Over *timeout* for the job, the driver's process group is killed and the
        job fails."""
        by_name = {run.get("name", run["backend"]): dict(run) for run in runs}
        probes = {name: probes_dir / f"{name}.jsonl" for name in by_name}
        results: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        remaining = list(by_name)
        while remaining:
            if self._proc is not None and self._proc.poll() is not None:
                self._finish()  # a run of the last job ended it after its result
            reused = self._proc is not None
            proc = self._proc or self._start()
            job = {
                "model": str(model),
                "prompts": prompts,
                "new_tokens": new_tokens,
                "runs": [{**by_name[name], "name": name, "probe": str(probes[name])} for name in remaining],
            }
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it ended since: seen below as the end of its output
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
            for _ in remaining:
                record = self._next_record(deadline, timeout)
                if record is None:
                    break
                results[record["name"]] = record
            missing = [name for name in remaining if name not in results]
            if missing:
                ended = self._finish()
                if reused and missing == remaining:
                    continue  # it was ending when the job came (a run of the last job ended it): a new driver
                results[missing[0]] = {
                    "name": missing[0],
                    "backend": by_name[missing[0]]["backend"],
                    "error": f"the engine driver died (exit status {ended.returncode}):\n{ended.stderr[-4000:]}",
                }
            remaining = missing[1:]
        return results, probes

    def close(self) -> None:
        """End the driver (it finishes when its stdin closes) and record what it left behind."""
        if self._proc is not None:
            self._finish()

    def _start(self) -> subprocess.Popen[str]:
        self._lines = queue.Queue()
        self._stdout, self._stderr = [], []
        proc = subprocess.Popen(
            driver_command("run_engine", "-"),
            env=self._env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        self._readers = [
            threading.Thread(target=_read_lines, args=(proc.stdout, self._stdout, self._lines), daemon=True),
            threading.Thread(target=_read_lines, args=(proc.stderr, self._stderr, None), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        self._proc = proc
        return proc

    def _next_record(self, deadline: float, timeout: float) -> dict[str, Any] | None:
        """The driver's next result line, or ``None`` once its output ends (the driver exited)."""
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                assert self._proc is not None
                kill_group(self._proc.pid)
                ended = self._finish()
                raise AssertionError(
                    f"run_engine ran over {timeout:.0f} s; its process group was killed.\n{ended.stderr[-3000:]}"
                ) from None
            if line is None:
                return None
            if line.startswith("{"):
                record: dict[str, Any] = json.loads(line)
                return record

    def _finish(self) -> Finished:
        proc, self._proc = self._proc, None
        assert proc is not None and proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        try:
            returncode = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            returncode = proc.wait()
        left = wait_group_empty(proc.pid, timeout=30)
        if left:
            kill_group(proc.pid)
        for reader in self._readers:
            reader.join(timeout=30)
        ended = Finished(returncode, "".join(self._stdout), "".join(self._stderr), proc.pid, describe(left))
        self.finished.append(ended)
        return ended


def _read_lines(stream: IO[str], kept: list[str], lines: queue.Queue[str | None] | None) -> None:
    """Keep every line of *stream* and pass each on to *lines*, then ``None`` when the stream ends."""
    for line in stream:
        kept.append(line)
        if lines is not None:
            lines.put(line)
    if lines is not None:
        lines.put(None)


def run_engines(
    model: Path,
    prompts: list[list[int]],
    new_tokens: int,
    runs: Sequence[Mapping[str, Any]],
    probes_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    path_entries: Sequence[str] = (),
    timeout: float = 540,
) -> EngineRuns:
    """Run each of *runs* (``{"name", "backend", "engine_args", "env"}``, see run_engine) in a driver of their own."""
    with EngineDriver(sglang_env(env, path_entries=path_entries)) as driver:
        results, probes = driver.run(model, prompts, new_tokens, runs, probes_dir, timeout)
    return EngineRuns(driver.finished, results, probes)


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
        ran = {
            r["method"]
            for r in records
            if r["event"] == "forward" and r["backend"] == runner["backend"] and r["pid"] == runner["pid"]
        }
        assert {"forward_extend", "forward_decode"} <= ran, f"{expected_class} ran only {sorted(ran)}"


def speculative_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a speculative run's probe saw, by role: each runner's backend class, the draft worker's decode container
    and draft-extend backend, and the forward modes each role's backends ran (the container's per-step children are
    the backends the draft's ``DECODE`` steps must have run on)."""
    runners = {r["runner"]: r for r in records if r["event"] == "runner"}
    role_of = {rid: ("draft" if r["is_draft_worker"] else "target") for rid, r in runners.items()}
    summary: dict[str, Any] = {
        "target_class": sorted({r["backend_class"] for r in runners.values() if not r["is_draft_worker"]}),
        "draft_class": sorted({r["backend_class"] for r in runners.values() if r["is_draft_worker"]}),
        "draft_backend": None,
        "modes": {"target": set(), "draft": set()},
        "classes": {"target": set(), "draft": set()},
        "container": None,
        "children": [],
        "children_modes": set(),
        "draft_extend_class": None,
    }
    for r in records:
        if r["event"] == "draft_backends":
            decode, extend = r["decode"] or {}, r["draft_extend"] or {}
            summary["container"] = decode.get("backend_class")
            summary["children"] = decode.get("children") or []
            summary["draft_extend_class"] = extend.get("backend_class")
            summary["draft_backend"] = sorted({part.get("stamp") for part in (decode, extend) if part})
    child_ids = {child for child, _ in summary["children"]}
    for r in records:
        if r["event"] != "forward" or r["mode"] is None or r["runner"] not in role_of:
            continue
        role = role_of[r["runner"]]
        summary["modes"][role].add(r["mode"])
        summary["classes"][role].add(r["backend_class"])
        if role == "draft" and r["backend"] in child_ids:
            summary["children_modes"].add(r["mode"])
    return summary


#: How much of a crashed engine's stderr a failure shows: the end, where the cause is.
ENGINE_ERROR_LINES = 25


def ids_mismatch(backend: str, case: str, got: list[list[int]], expected: list[list[int]]) -> str | None:
    """``None`` when the engine's greedy ids equal HF's, else one sentence naming the backend, the case and each
    differing prompt's first differing position (a list diff of every id would bury that)."""
    if got == expected:
        return None
    if len(got) != len(expected):
        return f"backend {backend!r}, {case}: {len(got)} outputs for {len(expected)} prompts"
    where = []
    for prompt, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        if mine == theirs:
            continue
        shorter = min(len(mine), len(theirs))
        position = next((i for i in range(shorter) if mine[i] != theirs[i]), shorter)
        ours = mine[position] if position < len(mine) else "nothing"
        hf = theirs[position] if position < len(theirs) else "nothing"
        where.append(f"prompt {prompt} first differs at new token {position} (engine {ours}, HF {hf})")
    return (
        f"backend {backend!r}, {case}: greedy ids differ from HF transformers': {'; '.join(where)} (the engine "
        "kit's dense cases, `-k test_sglang_dense_kit`, show whether the attention itself is off, and where)"
    )


def engine_failure(backend: str, case: str, error: str) -> str:
    """The failure of an engine run that did not finish: the backend, the case, the end of the engine's stderr."""
    lines = error.rstrip().splitlines()
    tail = lines[-ENGINE_ERROR_LINES:]
    cut = f"(last {len(tail)} of {len(lines)} lines)\n" if len(lines) > len(tail) else ""
    return f"backend {backend!r}, {case}: sglang.Engine failed: {cut}" + "\n".join(tail)
