"""TEST-ONLY: tiny Gemma 2 and gpt-oss models whose attention variants change HF's greedy ids, and HF's oracle.

Each model is seeded, random, two layers of width 64 (:data:`SHAPE`: one sliding-window layer, one full one),
float32, with the tiny Llama's tokenizer and vocabulary (:mod:`.llama`). What the trials showed each model needs
for its features to matter:

* Gemma 2: a window and a logit soft-cap of 5 on every layer, its q/k weights scaled up so that scores reach
  the cap; ``hidden_act`` beside transformers' ``hidden_activation`` (SGLang's and vLLM's Gemma 2 read it),
  tied embeddings, no final cap;
* gpt-oss: a window and attention sinks of spread N(0, 2^2), with the RoPE the engine kit passes in.

:func:`hf_greedy_each` is the oracle (HF eager, one prompt at a time, no padding, whose positions a window
would count), optionally with one feature switched off, so a test can assert that the feature changes the ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from attnhost_hf_models.llama import SEED, VOCAB, build_tokenizer, copy_tokenizer

__all__ = [
    "FEATURES",
    "LOGIT_CAP",
    "SHAPE",
    "WINDOW",
    "gemma2_config",
    "gpt_oss_config",
    "hf_greedy_each",
    "load",
    "special_ids",
    "variant_tokenizer",
    "write_variant_model",
]

#: HF's ``sliding_window`` W (a query sees W keys, itself included).
WINDOW = 5
#: Gemma 2's attention soft-cap.
LOGIT_CAP = 5.0
#: The features each shared model has, as :func:`hf_greedy_each`'s ``without`` names them.
FEATURES = {
    "gemma2": ("sliding_window", "logit_cap"),
    "gpt_oss": ("sliding_window", "sinks"),
}
SHAPE = {
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


def variant_tokenizer(out: Path, *, seed: int = SEED, tokenizer_from: Path | None = None) -> Any:
    """Create *out* with the tiny Llama's tokenizer (copied from *tokenizer_from*, else trained with *seed*) and
    return it loaded."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        build_tokenizer(out, seed)
    else:
        copy_tokenizer(tokenizer_from, out)
    return AutoTokenizer.from_pretrained(out)


def special_ids(tok: Any) -> dict[str, Any]:
    """BOS, EOS and (EOS as) padding ids of *tok*, as config keywords."""
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}


def gemma2_config(tok: Any) -> Any:
    """The tiny Gemma 2: window and soft-cap on every layer, tied embeddings, no final cap."""
    from transformers import Gemma2Config

    return Gemma2Config(
        **SHAPE,
        **special_ids(tok),
        intermediate_size=128,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=LOGIT_CAP,
        final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )


def gpt_oss_config(tok: Any, rope_parameters: dict[str, Any]) -> Any:
    """The tiny gpt-oss (four experts, two per token) with the engine's *rope_parameters*."""
    from transformers import GptOssConfig

    return GptOssConfig(
        **SHAPE,
        **special_ids(tok),
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


def write_variant_model(
    kind: str,
    config: Any,
    out: Path,
    seed: int,
    *,
    bfloat16_sinks: bool = False,
    architectures: list[str] | None = None,
) -> None:
    """Write the seeded random *kind* model of *config* (float32) to *out*, beside its tokenizer.

    Gemma 2's q/k weights are scaled up (scores reach the cap); gpt-oss's sinks drawn from N(0, 2^2), rounded to
    bfloat16 if *bfloat16_sinks* (an engine that keeps them in bfloat16). The written config gets ``hidden_act``
    and, when given, *architectures*.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if kind == "gemma2":
                attn.q_proj.weight.mul_(_QK_SCALE)
                attn.k_proj.weight.mul_(_QK_SCALE)
            if kind == "gpt_oss":
                sinks = torch.randn(attn.sinks.shape, generator=torch.Generator().manual_seed(seed)) * _SINK_STD
                attn.sinks.copy_(sinks.to(torch.bfloat16).to(torch.float32) if bfloat16_sinks else sinks)
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    written.setdefault("hidden_act", written.get("hidden_activation", "gelu_pytorch_tanh"))  # the engines' Gemma 2
    if architectures is not None:
        written["architectures"] = architectures
    (out / "config.json").write_text(json.dumps(written, indent=2))


def load(model_dir: Path, without: str | None) -> Any:
    """HF's model at *model_dir* (eager attention, float32), with feature *without* (``sliding_window``,
    ``logit_cap``, ``sinks``) switched off when given."""
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
    """HF transformers' greedy continuation (eager attention, float32) of each prompt on its own (no padding, whose
    positions a window would count), optionally with one feature (``without``) switched off."""
    import torch
    from transformers import GenerationConfig

    model = load(model_dir, without)
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
