"""The documented command for speculative decoding by hand on a CPU (docs/speculative-cpu.md) runs as written.

``python -m attnhost_sglang_cpu.speculative_demo`` builds the tiny models
itself, sets the CPU environment for the engine itself (the caller's shell
has none of it, and a stray ``SGLANG_*`` setting there must not leak in), and
runs a real ``sglang.Engine``: one run, a tree, which is the harder of the
two (the engine kit runs the chain).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import subprocess_env

DOC = Path(__file__).resolve().parents[2] / "docs" / "speculative-cpu.md"


def test_the_documented_command_runs_a_tree_and_prints_ids_hf_and_acceptance(tmp_path: Path) -> None:
    """The documented demo, run as a reader would: its engine (a speculative tree by hand on the batched example)
    is a configuration no other test starts."""
    assert "python -m attnhost_sglang_cpu.speculative_demo --backend acme" in DOC.read_text()
    shell = {"SGLANG_PLATFORM": "cuda", "TRITON_INTERPRET": "0", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    demo = ("-m", "attnhost_sglang_cpu.speculative_demo", "--backend", "batched_matmul", "--topk", "2")
    proc = subprocess.run(
        [sys.executable, *demo, "--workdir", str(tmp_path / "models")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=subprocess_env((), shell),
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "tree (STANDALONE, topk 2, 3 steps, 4 draft tokens):" in out and "chain (" not in out, out
    engine = re.findall(r"prompt (\d): engine (\[[\d, ]+\])\n\s+HF     (\[[\d, ]+\])\n\s+equal: (\w+)", out)
    assert [(p, equal) for p, _, _, equal in engine] == [("0", "yes"), ("1", "yes")], out
    assert all(ours == hf and len(ours.split(",")) == 8 for _, ours, hf, _ in engine), out
    accepted = [int(x) for x in re.findall(r"tokens per verify step [\d.]+, draft tokens accepted (\d+)%", out)]
    assert len(accepted) == 2 and all(a > 0 for a in accepted), out  # the draft is a copy: drafts accepted
    assert "target runner: SGLangAdapterBackend" in out and "draft runner: SGLangAdapterBackend" in out, out
    assert out.rstrip().endswith("speculative greedy ids equal HF transformers': yes"), out
