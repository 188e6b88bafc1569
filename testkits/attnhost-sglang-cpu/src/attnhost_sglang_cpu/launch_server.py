"""TEST-ONLY: ``python -m attnhost_sglang_cpu.launch_server ARGS`` is ``python -m sglang.launch_server ARGS`` with
the torchvision shim installed first.

``sglang.launch_server`` imports torchvision (through ``sglang.srt.configs``)
before anything else runs, so the shim has to be installed first, in this
process and in every child SGLang spawns: the spawned children re-import this
module as ``__mp_main__``, which runs the module-level :func:`shim.install`
again but not the server (that is under ``__main__``).
"""

from __future__ import annotations

import runpy

from attnhost_sglang_cpu import shim

shim.install()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__")
