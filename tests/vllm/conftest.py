"""vLLM 0.33 on the CPU: its plugin loader, registry, config parsing and attention base classes, for real.

``VLLM_TARGET_DEVICE=cpu`` before vLLM is imported: the CUDA build of
``vllm._C`` is never needed for these paths. attnhost registers through
vLLM's own ``load_general_plugins()`` once per test process (vLLM's loader
runs once per process by design); scenarios that need other environment
settings run in their own interpreter (see ``scenarios.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_plugins_loaded() -> None:
    """What every vLLM process does first: vLLM's own general-plugin loader, with attnhost's entry point."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


TINY_LLAMA = {
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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local model directory (config only): vLLM's config parsing needs no download and no weights."""
    import json

    model = Path(tmp_path_factory.mktemp("tiny-llama"))
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(model)
