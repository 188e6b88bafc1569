"""TEST-ONLY: the tiny Llama-style model, its tokenizer and draft models vLLM's tests run, made locally and seeded.

The builders are :mod:`attnhost_hf_models.llama`'s (shared with the SGLang kit), with vLLM's shape and EAGLE
head layout. The weights are random, so the generated text means nothing; what the tests compare is token ids,
greedy, between HF transformers and vLLM. The tokenizer is a byte-level BPE trained on a seeded synthetic corpus
with exactly ``VOCAB`` entries, so every id the model can produce decodes. Draft models for speculative decoding
(:func:`build_draft_model`) share the target's tokenizer and vocabulary: a smaller random one (its drafts are
mostly rejected, so the output must still equal the target's) or a copy of the target (its drafts are accepted).
"""

from __future__ import annotations

try:
    from attnhost_hf_models import llama
except ModuleNotFoundError as exc:  # installed by path beside this kit, so a recipe can leave it out
    raise ModuleNotFoundError(
        "the vLLM CPU engine kit builds its models with the test-only kit attnhost-hf-models: "
        "pip install --no-deps testkits/attnhost-hf-models (attnhost's repository)"
    ) from exc
from attnhost_hf_models.llama import (
    DRAFT_LAYERS,
    DRAFT_SEED,
    PROMPTS,
    SEED,
    SPECIAL,
    TOKENIZER_FILES,
    VOCAB,
    build_tokenizer,
    prompt_ids,
)

__all__ = [
    "DRAFT_LAYERS",
    "DRAFT_SEED",
    "LLAMA_SHAPE",
    "PROMPTS",
    "SEED",
    "SPECIAL",
    "TOKENIZER_FILES",
    "VOCAB",
    "build_draft_model",
    "build_eagle_head",
    "build_model",
    "build_tokenizer",
    "hf_greedy",
    "prompt_ids",
]

#: The tiny Llama's shape: head size 32, the smallest vLLM's ``CPU_ATTN`` computes (the all-``CPU_ATTN`` reference
#: runs need it), and grouped queries (two query heads per KV head).
LLAMA_SHAPE = llama.llama_shape(num_attention_heads=2, num_key_value_heads=1)


# vLLM's EAGLE head (``vllm.model_executor.models.llama_eagle``, architecture ``EagleLlamaForCausalLM``) feeds
# ``fc(cat(embed(token), target hidden))`` (no bias) through its decoder layers, the first without its input norm,
# and no final norm; its checkpoint names drop the ``model.`` prefix (its ``load_weights`` adds it back). So: one
# Llama decoder layer of the target's width, the embedding, and ``fc`` (``2 * hidden -> hidden``); the LM head is
# the target's. HF's reference runs eager attention (float32, batched, left-padded, EOS not special).
_LLAMA = llama.TinyLlama(
    LLAMA_SHAPE,
    eagle_architecture="EagleLlamaForCausalLM",
    eagle_dropped=frozenset({"model.norm.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"}),
    eagle_fc_bias=False,
    eager_llama=True,
)
build_model = _LLAMA.build_model
build_draft_model = _LLAMA.build_draft_model
build_eagle_head = _LLAMA.build_eagle_head
hf_greedy = _LLAMA.hf_greedy
