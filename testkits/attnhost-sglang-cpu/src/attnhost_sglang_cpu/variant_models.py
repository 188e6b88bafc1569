"""TEST-ONLY: tiny Gemma 2, Gemma 3, gpt-oss and Mistral models whose attention variants change the greedy ids.

Each model is seeded, random, two layers of width 64 (one sliding-window layer, one full one), with the tiny
Llama's tokenizer and vocabulary (:mod:`.tiny_model`), written where SGLang and HF transformers both load it
(Gemma 2, gpt-oss and the oracle are :mod:`attnhost_hf_models.variants`', shared with the vLLM engine kit):

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

from pathlib import Path
from typing import Any

from attnhost_hf_models import variants
from attnhost_hf_models.variants import LOGIT_CAP as LOGIT_CAP
from attnhost_hf_models.variants import SHAPE, WINDOW, hf_greedy_each

from attnhost_sglang_cpu.tiny_model import SEED

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

# WINDOW is HF's ``sliding_window`` W (a query sees W keys, itself included): SGLang's ``sliding_window_size`` is
# W - 1. LOGIT_CAP is Gemma 2's attention soft-cap.
#: Longer than the window, and different, so a mixed-up batch or a window read wrong changes the ids.
VARIANT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while attention is all we need to know",
    "Attention is all you need and the fox jumps over",
)
#: The features each model has, as ``hf_greedy_without`` names them.
FEATURES = {
    "gemma2": variants.FEATURES["gemma2"],
    "gemma3": ("sliding_window",),
    "gpt_oss": variants.FEATURES["gpt_oss"],
}
VARIANT_MODELS = tuple(FEATURES)


def _config(kind: str, tok: Any) -> Any:
    if kind == "gemma2":
        return variants.gemma2_config(tok)
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **SHAPE,
            **variants.special_ids(tok),
            intermediate_size=128,
            query_pre_attn_scalar=16,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            architectures=["Gemma3ForCausalLM"],
        )
    if kind == "gpt_oss":
        return variants.gpt_oss_config(tok, {"rope_type": "default", "rope_theta": 10000.0})
    if kind == "mistral":
        from transformers import MistralConfig

        shape = {k: v for k, v in SHAPE.items() if k != "layer_types"}
        return MistralConfig(**shape, **variants.special_ids(tok), intermediate_size=128, tie_word_embeddings=False)
    raise ValueError(f"unknown variant model {kind!r}: use one of {', '.join((*VARIANT_MODELS, 'mistral'))}")


def build_variant_model(kind: str, out: Path, *, tokenizer_from: Path | None = None, seed: int = SEED) -> None:
    """Write the seeded tiny *kind* model (``gemma2``, ``gemma3``, ``gpt_oss``, ``mistral``), float32, to *out*.

    gpt-oss's sinks are rounded to bfloat16 (SGLang keeps them so); Gemma 3's config names ``Gemma3ForCausalLM``.
    """
    tok = variants.variant_tokenizer(out, tokenizer_from=tokenizer_from)
    config = _config(kind, tok)
    architectures = ["Gemma3ForCausalLM"] if kind == "gemma3" else None
    variants.write_variant_model(kind, config, out, seed, bfloat16_sinks=True, architectures=architectures)


def variant_prompt_ids(model_dir: Path) -> list[list[int]]:
    """:data:`VARIANT_PROMPTS` as token ids, BOS first; each longer than :data:`WINDOW`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in VARIANT_PROMPTS]
    assert all(len(p) > 2 * WINDOW for p in prompts), [len(p) for p in prompts]
    return prompts


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
