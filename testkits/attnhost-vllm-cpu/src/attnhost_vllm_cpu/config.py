"""A ``VllmConfig`` built the way ``vllm serve`` builds one, for a config-only local model (no download, no weights).

vLLM's own parser (``EngineArgs.add_cli_args`` on a ``FlexibleArgumentParser``),
``EngineArgs.from_cli_args`` and ``create_engine_config``: the path
``--attention-backend NAME`` really takes, ending in the
``AttentionBackendEnum`` member the engine's processes receive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TINY_LLAMA", "engine_config", "parse_engine_args", "write_tiny_model"]

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
"""A Llama's ``config.json``: all vLLM's config parsing reads of a model."""


def write_tiny_model(directory: Path) -> str:
    """Write :data:`TINY_LLAMA` as ``directory/config.json``; return the directory as ``--model`` takes it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(directory)


def parse_engine_args(model: str, attention_backend: str, draft_backend: str | None = None) -> Any:
    """vLLM's ``EngineArgs`` from its own parser for ``--attention-backend`` (and an ngram draft on *draft_backend*)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [
        "--model",
        model,
        "--skip-tokenizer-init",
        "--max-model-len",
        "256",
        "--attention-backend",
        attention_backend,
    ]
    if draft_backend is not None:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 3,
            "attention_backend": draft_backend,
        }
        argv += ["--speculative-config", json.dumps(speculative)]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def engine_config(model: str, attention_backend: str, draft_backend: str | None = None) -> Any:
    """The ``VllmConfig`` vLLM builds from those arguments (what its EngineCore and workers are handed)."""
    return parse_engine_args(model, attention_backend, draft_backend).create_engine_config()
