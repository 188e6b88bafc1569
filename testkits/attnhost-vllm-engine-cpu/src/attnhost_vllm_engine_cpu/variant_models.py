"""TEST-ONLY: tiny Gemma 2 and gpt-oss models whose attention variants change HF's greedy ids.

The same approach as the SGLang kit's variant models, kept to what a vLLM engine needs: seeded, random, two
layers of width 64 (one sliding-window layer, one full one), the tiny Llama's tokenizer and vocabulary
(:mod:`.tiny_model`), float32, written where vLLM and HF transformers both load them. What the trials showed
each model needs for its features to matter:

* Gemma 2: a window and a logit soft-cap of 5 on every layer, its q/k weights scaled up so that scores reach
  the cap; ``hidden_act`` beside transformers' ``hidden_activation``, tied embeddings, no final cap;
* gpt-oss: a window and attention sinks of spread N(0, 2^2); YaRN positions with factor 1 (vLLM's gpt-oss
  always builds YaRN, which at factor 1 is plain RoPE on both sides).

:func:`prepare` is the oracle: HF eager, each prompt on its own (no padding, whose positions a window would
count), after asserting that switching each of the model's features off changes those ids, else an engine
test on the model would prove nothing about the feature.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnhost_vllm_engine_cpu.engines import BASE_ENGINE_ARGS
from attnhost_vllm_engine_cpu.tiny_model import SEED, VOCAB, build_tokenizer

__all__ = ["FEATURES", "WINDOW", "VariantModel", "build_variant_model", "hf_greedy_each", "prepare", "variant_run"]

#: HF's ``sliding_window`` W, which vLLM passes on as it is (a query sees W keys, itself included).
WINDOW = 5
LOGIT_CAP = 5.0
#: The features each model has, as :func:`hf_greedy_each`'s ``without`` names them.
FEATURES = {
    "gemma2": ("sliding_window", "logit_cap"),
    "gpt_oss": ("sliding_window", "sinks"),
}
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": WINDOW,
}
_QK_SCALE = 30.0  # Gemma 2's q/k weights times this: scores of tens, which a cap of 5 bends
_SINK_STD = 2.0


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
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(
            **_SHAPE,
            **ids,
            intermediate_size=128,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=LOGIT_CAP,
            final_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
    if kind == "gpt_oss":
        from transformers import GptOssConfig

        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
        return GptOssConfig(
            **_SHAPE,
            **ids,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={**yarn, "truncate": False, "original_max_position_embeddings": 512},
            tie_word_embeddings=False,
            initializer_range=0.1,
        )
    raise ValueError(f"unknown variant model {kind!r}: use one of {', '.join(FEATURES)}")


def build_variant_model(kind: str, out: Path, seed: int = SEED) -> None:
    """Write the seeded tiny *kind* model (``gemma2``, ``gpt_oss``) and its tokenizer to *out*."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, seed)
    config = _config(kind, AutoTokenizer.from_pretrained(out))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if kind == "gemma2":
                attn.q_proj.weight.mul_(_QK_SCALE)
                attn.k_proj.weight.mul_(_QK_SCALE)
            if kind == "gpt_oss":
                attn.sinks.copy_(
                    torch.randn(attn.sinks.shape, generator=torch.Generator().manual_seed(seed)) * _SINK_STD
                )
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    written.setdefault("hidden_act", written.get("hidden_activation", "gelu_pytorch_tanh"))
    (out / "config.json").write_text(json.dumps(written, indent=2))


def _load(model_dir: Path, without: str | None) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if without == "sliding_window":
        config.sliding_window = 1 << 20
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    elif without == "logit_cap":
        config.attn_logit_softcapping = None
    elif without not in (None, "sinks"):
        raise ValueError(f"unknown feature {without!r}: use sliding_window, logit_cap or sinks")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if without == "sinks":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-math.inf)
    return model


def hf_greedy_each(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, *, without: str | None = None
) -> list[list[int]]:
    """HF transformers' greedy continuation (eager attention, float32) of each prompt on its own, optionally with
    one feature (``without``) switched off."""
    import torch
    from transformers import GenerationConfig

    model = _load(model_dir, without)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
    )
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out[0, len(prompt) :].tolist())
    return outs


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
