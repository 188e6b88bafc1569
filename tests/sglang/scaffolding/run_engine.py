"""Run one real ``sglang.Engine`` generation and print its greedy ids as JSON (test scaffolding).

``python run_engine.py MODEL_DIR BACKEND NEW_TOKENS PROMPT_IDS_JSON`` prints one
JSON line ``{"output_ids": [[...], ...]}``. tests/sglang/test_engine.py runs
it in a fresh interpreter per backend so that SGLang's process-wide state
(signal handlers, the multiprocessing start method, the plugin-load guard, the
platform singleton) never leaks into pytest. The torchvision shim is installed
at module level, before SGLang is imported, because SGLang's spawned
scheduler re-imports this file as ``__mp_main__`` and needs it too.
"""

from __future__ import annotations

import json
import sys

import shim

shim.install()


def main(argv: list[str]) -> int:
    model_dir, backend, new_tokens, prompts = argv[0], argv[1], int(argv[2]), json.loads(argv[3])
    import sglang as sgl

    engine = sgl.Engine(
        model_path=model_dir,
        device="cpu",
        attention_backend=backend,
        max_total_tokens=4096,
        dtype="float32",
        random_seed=0,
        log_level="error",
    )
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    print(json.dumps({"output_ids": [out["output_ids"] for out in outs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
