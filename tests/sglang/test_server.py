"""The SGLang HTTP server, started as operators start it, answers with HF transformers' greedy ids.

``python -m sglang.launch_server`` runs through the test kit's
``python -m attnhost_sglang_cpu.launch_server`` (which only installs the
torchvision shim first) on 127.0.0.1 and a free port, in its own process
group. The test waits for ``/health`` within a bound, asks ``/generate`` and
``/v1/completions``, ends the server by its PID and then
checks that no process of its group and no listener on its port is left.
The backend is ``tiny``, a third-party attnhost plugin (examples/attnhost-tiny).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attnhost_sglang_cpu import PROBE_ENV, driver_command, sglang_env
from attnhost_sglang_cpu.e2e import ADAPTER, TinyModel, check_probe, read_probe
from attnhost_sglang_cpu.procs import describe, free_port, kill_group, port_is_free, wait_group_empty
from conftest import NEW_TOKENS

HEALTH_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0

#: The backend served and the class its model runner must build. One server start costs as much as an engine
#: test case, so only the plugin case runs; SGLang's own torch_native through the same scaffolding is the
#: engine test's first case.
SERVED = {"tiny": ADAPTER}


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Server:
    def __init__(self, backend: str, proc: subprocess.Popen[bytes], port: int, log: Path, probe: Path) -> None:
        self.backend, self.proc, self.port, self.log, self.probe = backend, proc, port, log, probe
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_healthy(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < HEALTH_TIMEOUT_S:
            if self.proc.poll() is not None:
                status = self.proc.returncode
                pytest.fail(f"the server exited with status {status} before it was healthy:\n{self.log_tail()}")
            if _healthy(self.url + "/health"):
                return time.monotonic() - start
            time.sleep(0.5)
        pytest.fail(f"the server was not healthy within {HEALTH_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> tuple[int | None, str]:
        """SIGTERM to the server's PID, as an operator would; whatever of its group outlives the bound is killed
        (so nothing is left even when the test fails) and reported."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        left = wait_group_empty(self.proc.pid, timeout=STOP_TIMEOUT_S)
        report = describe(left)
        if left or self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait(timeout=30)
        return self.proc.returncode, report


@pytest.fixture(params=list(SERVED))
def server(request: pytest.FixtureRequest, tiny_model: TinyModel, tmp_path: Path) -> Iterator[Server]:
    """``sglang.launch_server`` with one backend, stopped after the test: a server no other test starts."""
    backend: str = request.param
    port = free_port()
    probe = tmp_path / "probe.jsonl"
    log = tmp_path / "server.log"
    cmd = driver_command(
        "launch_server",
        "--model-path",
        str(tiny_model.path),
        "--device",
        "cpu",
        "--attention-backend",
        backend,
        "--max-total-tokens",
        "4096",
        "--dtype",
        "float32",
        "--random-seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=sglang_env({PROBE_ENV: str(probe)}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so the test can prove the whole group is gone
        )
    srv = Server(backend, proc, port, log, probe)
    try:
        yield srv
    finally:
        srv.stop()


def test_server_answers_with_hf_ids(server: Server, tiny_model: TinyModel) -> None:
    server.wait_healthy()
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

    generated = _post(server.url + "/generate", {"input_ids": tiny_model.prompts, "sampling_params": sampling})
    assert [out["output_ids"] for out in generated] == tiny_model.hf_ids

    completion = _post(
        server.url + "/v1/completions",
        {
            "model": str(tiny_model.path),
            "prompt": tiny_model.prompts,
            "max_tokens": NEW_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    choices = sorted(completion["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == tiny_model.hf_ids
    assert [c["prompt_token_ids"] for c in choices] == tiny_model.prompts

    check_probe(read_probe(server.probe), server.backend, SERVED[server.backend], not_pid=server.proc.pid)

    returncode, left = server.stop()
    assert left == "none", f"the server left processes behind after SIGTERM: {left}"
    assert returncode is not None
    assert port_is_free(server.port), f"port {server.port} still taken after the server ended"
