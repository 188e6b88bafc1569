"""TEST-ONLY: tiny Gemma 2 and gpt-oss models whose attention variants change HF's greedy ids.

The same approach as the SGLang kit's variant models (both build with :mod:`attnhost_hf_models.variants`), kept
to what a vLLM engine needs: seeded, random, two layers of width 64 (one sliding-window layer, one full one), the
tiny Llama's tokenizer and vocabulary (:mod:`.tiny_model`), float32, written where vLLM and HF transformers both
load them. What the trials showed each model needs for its features to matter:

* Gemma 2: a window and a logit soft-cap of 5 on every layer, its q/k weights scaled up so that scores reach
  the cap; ``hidden_act`` beside transformers' ``hidden_activation``, tied embeddings, no final cap;
* gpt-oss: a window and attention sinks of spread N(0, 2^2); YaRN positions with factor 1 (vLLM's gpt-oss
  always builds YaRN, which at factor 1 is plain RoPE on both sides).

:func:`prepare` is the oracle: HF eager, each prompt on its own (no padding, whose positions a window would
count), after asserting that switching each of the model's features off changes those ids, else an engine
test on the model would prove nothing about the feature.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnhost_hf_models import variants
from attnhost_hf_models.variants import LOGIT_CAP as LOGIT_CAP
from attnhost_hf_models.variants import WINDOW, hf_greedy_each

from attnhost_vllm_engine_cpu.engines import BASE_ENGINE_ARGS
from attnhost_vllm_engine_cpu.tiny_model import SEED, VOCAB

__all__ = ["FEATURES", "WINDOW", "VariantModel", "build_variant_model", "hf_greedy_each", "prepare", "variant_run"]

# WINDOW is HF's ``sliding_window`` W, which vLLM passes on as it is (a query sees W keys, itself included).
#: The features each model has, as :func:`hf_greedy_each`'s ``without`` names them.
FEATURES = variants.FEATURES
#: vLLM's gpt-oss always builds YaRN, which at factor 1 is plain RoPE on both sides.
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 512,
}


@dataclass(frozen=True)
class VariantModel:
    """A tiny variant model, its prompts (a first pass and a prefix-cached second one) and HF's greedy ids."""

    kind: str
    path: Path
    prompts: list[list[int]]
    second_pass: list[list[int]]
    hf_ids: list[list[int]]
    hf_second: list[list[int]]


def _config(kind: str, tok: Any) -> Any:
    if kind == "gemma2":
        return variants.gemma2_config(tok)
    if kind == "gpt_oss":
        return variants.gpt_oss_config(tok, _GPT_OSS_ROPE)
    raise ValueError(f"unknown variant model {kind!r}: use one of {', '.join(FEATURES)}")


def build_variant_model(kind: str, out: Path, seed: int = SEED) -> None:
    """Write the seeded tiny *kind* model (``gemma2``, ``gpt_oss``) and its tokenizer to *out*."""
    config = _config(kind, variants.variant_tokenizer(out, seed=seed))
    variants.write_variant_model(kind, config, out, seed)


def _prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts many windows long, over vLLM's 32-token blocks (so a second pass hits the prefix cache), and the
    second pass: the same prompts again and one sharing the longer one's first 64 tokens."""
    rng = random.Random(seed)
    first = [[1, *(rng.randrange(2, VOCAB) for _ in range(n))] for n in (39, 70)]
    second = [*first, [*first[1][:64], *(rng.randrange(2, VOCAB) for _ in range(9))]]
    return first, second


def prepare(kind: str, out: Path, new_tokens: int) -> VariantModel:
    """Build the *kind* model at *out* and HF's greedy ids for its prompts, asserting first that switching each of
    its features off changes them."""
    build_variant_model(kind, out)
    first, second = _prompts()
    hf = hf_greedy_each(out, second, new_tokens)
    for feature in FEATURES[kind]:
        without = hf_greedy_each(out, second, new_tokens, without=feature)
        assert without != hf, f"tiny {kind}: switching {feature} off leaves HF's greedy ids as they are"
    return VariantModel(kind, out, first, second, hf[: len(first)], hf)


def variant_run(model: VariantModel, backend: str, max_tokens: int, **engine_args: Any) -> dict[str, Any]:
    """A run for :func:`~attnhost_vllm_engine_cpu.engines.run_engines` on *model*'s engine with *backend*: its
    prompts, then its second pass (prefix-cached)."""
    args = {**BASE_ENGINE_ARGS, "attention_backend": backend, **engine_args}
    return {
        "model": str(model.path),
        "engine_args": args,
        "passes": [model.prompts, model.second_pass],
        "max_tokens": max_tokens,
    }
