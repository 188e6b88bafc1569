"""Start SGLang processes in their own process group and prove they left nothing behind (test helpers)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on *port* (as servers do, with SO_REUSEADDR, so closed connections
    still in TIME_WAIT do not count: only a live socket bound to the port does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes (zombies included: someone still has to reap them) in process group *pgid*."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    return members


def wait_group_empty(pgid: int, timeout: float) -> list[psutil.Process]:
    """Poll until group *pgid* is empty or *timeout* passes; return what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def describe(procs: Sequence[psutil.Process]) -> str:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]}")
    return "; ".join(out) or "none"


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    pid: int
    leftover: str  # processes of its group still alive after it exited ("none" when clean)


def run_in_group(cmd: Sequence[str], env: Mapping[str, str], timeout: float) -> Finished:
    """Run *cmd* as the leader of a new process group; on timeout, kill the whole group and raise."""
    proc = subprocess.Popen(
        list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as err:
        kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        message = f"{cmd[1]} ran over {timeout:.0f} s; its process group was killed.\n{stderr[-3000:]}"
        raise AssertionError(message) from err
    left = wait_group_empty(proc.pid, timeout=30)
    leftover = describe(left)
    if left:
        kill_group(proc.pid)
    return Finished(proc.returncode, stdout, stderr, proc.pid, leftover)
