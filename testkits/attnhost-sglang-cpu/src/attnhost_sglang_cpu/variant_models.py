"""TEST-ONLY: tiny Gemma 2, Gemma 3, gpt-oss and Mistral models whose attention variants change the greedy ids.

Each model is seeded, random, two layers of width 64 (one sliding-window layer, one full one), with the tiny
Llama's tokenizer and vocabulary (:mod:`.tiny_model`), written where SGLang and HF transformers both load it:

* Gemma 2: a window and a logit soft-cap of 5 on every layer; its q/k weights are scaled up so that scores
  reach the cap. SGLang's Gemma 2 reads ``hidden_act`` (transformers 5 writes only ``hidden_activation``),
  uses ``embed_tokens`` as its LM head (so: tied) and applies the *final* logit cap with a triton kernel the
  triton interpreter cannot run, so that cap stays off;
* Gemma 3: a window (its hybrid layer pattern), no cap;
* gpt-oss: a window and attention sinks of spread N(0, 2^2), rounded to bfloat16 because SGLang keeps them in
  bfloat16 for every backend but trtllm_mha;
* Mistral: a config with ``sliding_window`` that SGLang's Mistral code drops (for the start-up warning).

:func:`hf_greedy_each` is the oracle (HF eager, one prompt at a time, no padding); :func:`hf_greedy_without`
runs it with one feature switched off, so a test can assert that the feature changes the ids at all.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from attnhost_sglang_cpu.tiny_model import SEED, TOKENIZER_FILES, build_tokenizer

__all__ = [
    "FEATURES",
    "VARIANT_MODELS",
    "VARIANT_PROMPTS",
    "WINDOW",
    "build_variant_model",
    "hf_greedy_each",
    "hf_greedy_without",
    "prepare_variant_model",
    "variant_prompt_ids",
]

#: HF's ``sliding_window`` W (a query sees W keys, itself included): SGLang's ``sliding_window_size`` is W - 1.
WINDOW = 5
#: Gemma 2's attention soft-cap.
LOGIT_CAP = 5.0
#: Longer than the window, and different, so a mixed-up batch or a window read wrong changes the ids.
VARIANT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while attention is all we need to know",
    "Attention is all you need and the fox jumps over",
)
#: The features each model has, as ``hf_greedy_without`` names them.
FEATURES = {
    "gemma2": ("sliding_window", "logit_cap"),
    "gemma3": ("sliding_window",),
    "gpt_oss": ("sliding_window", "sinks"),
}
VARIANT_MODELS = tuple(FEATURES)
_SHAPE = {
    "vocab_size": 1024,
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


def _tokenizer(out: Path, tokenizer_from: Path | None) -> Any:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        build_tokenizer(out, SEED)
    else:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copy2(tokenizer_from / name, out / name)
    return AutoTokenizer.from_pretrained(out)


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
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **_SHAPE,
            **ids,
            intermediate_size=128,
            query_pre_attn_scalar=16,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            architectures=["Gemma3ForCausalLM"],
        )
    if kind == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            **_SHAPE,
            **ids,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            initializer_range=0.1,
        )
    if kind == "mistral":
        from transformers import MistralConfig

        shape = {k: v for k, v in _SHAPE.items() if k != "layer_types"}
        return MistralConfig(**shape, **ids, intermediate_size=128, tie_word_embeddings=False)
    raise ValueError(f"unknown variant model {kind!r}: use one of {', '.join((*VARIANT_MODELS, 'mistral'))}")


def build_variant_model(kind: str, out: Path, *, tokenizer_from: Path | None = None, seed: int = SEED) -> None:
    """Write the seeded tiny *kind* model (``gemma2``, ``gemma3``, ``gpt_oss``, ``mistral``), float32, to *out*."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(out, tokenizer_from)
    config = _config(kind, tok)
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
                attn.sinks.copy_(sinks.to(torch.bfloat16).to(torch.float32))
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    written.setdefault("hidden_act", written.get("hidden_activation", "gelu_pytorch_tanh"))  # SGLang's Gemma 2
    if kind == "gemma3":
        written["architectures"] = ["Gemma3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(written, indent=2))


def variant_prompt_ids(model_dir: Path) -> list[list[int]]:
    """:data:`VARIANT_PROMPTS` as token ids, BOS first; each longer than :data:`WINDOW`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in VARIANT_PROMPTS]
    assert all(len(p) > 2 * WINDOW for p in prompts), [len(p) for p in prompts]
    return prompts


def _load(model_dir: Path, without: str | None) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if without == "sliding_window":
        config.sliding_window = 1 << 20
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    elif without == "logit_cap":
        config.attn_logit_softcapping = None
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if without == "sinks":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-math.inf)
    elif without not in (None, "sliding_window", "logit_cap"):
        raise ValueError(f"unknown feature {without!r}: use sliding_window, logit_cap or sinks")
    return model


def hf_greedy_each(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, *, without: str | None = None
) -> list[list[int]]:
    """HF transformers' greedy continuation (eager attention, float32) of each prompt on its own (no padding, whose
    positions a window would count), optionally with one feature (``without``) switched off."""
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


def hf_greedy_without(model_dir: Path, prompts: list[list[int]], new_tokens: int, feature: str) -> list[list[int]]:
    """:func:`hf_greedy_each` with *feature* (``sliding_window``, ``logit_cap``, ``sinks``) switched off."""
    return hf_greedy_each(model_dir, prompts, new_tokens, without=feature)


def prepare_variant_model(kind: str, out: Path, new_tokens: int, *, tokenizer_from: Path | None = None) -> Any:
    """Build the *kind* model at *out* and its oracle: a :class:`~attnhost_sglang_cpu.e2e.TinyModel` with HF's
    greedy ids, after checking in HF that switching each of the model's features off changes them (else an
    engine test on it would prove nothing about that feature)."""
    from attnhost_sglang_cpu.e2e import TinyModel

    build_variant_model(kind, out, tokenizer_from=tokenizer_from)
    prompts = variant_prompt_ids(out)
    hf_ids = hf_greedy_each(out, prompts, new_tokens)
    assert hf_ids[0] != hf_ids[1], hf_ids
    for feature in FEATURES.get(kind, ()):
        without = hf_greedy_without(out, prompts, new_tokens, feature)
        assert without != hf_ids, f"tiny {kind}: switching {feature} off leaves HF's greedy ids as they are"
    return TinyModel(out, prompts, hf_ids)
