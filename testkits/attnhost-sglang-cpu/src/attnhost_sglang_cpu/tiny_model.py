"""TEST-ONLY: the tiny Llama-style model, its tokenizer and draft models SGLang's tests run, made locally and seeded.

The builders are :mod:`attnhost_hf_models.llama`'s (shared with the vLLM engine kit), with SGLang's shape and
EAGLE head layout; the tiny DeepSeek-V2 (multi-head latent attention) is SGLang's alone. The weights are random,
so the generated text means nothing; what the tests compare is token ids, greedy, between HF transformers and
SGLang. The tokenizer is a byte-level BPE trained on a seeded synthetic corpus with exactly ``VOCAB`` entries, so
every id the model can produce decodes. Draft models for speculative decoding (:func:`build_draft_model`) share
the target's tokenizer and vocabulary: a smaller random one (its drafts are mostly rejected, so the output must
still equal the target's) or a copy of the target (its drafts are accepted).
"""

from __future__ import annotations

from pathlib import Path

try:
    from attnhost_hf_models import llama
except ModuleNotFoundError as exc:  # installed by path beside this kit, so a recipe can leave it out
    raise ModuleNotFoundError(
        "the SGLang engine kit builds its models with the test-only kit attnhost-hf-models: "
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
    copy_tokenizer,
    prompt_ids,
)

__all__ = [
    "DEEPSEEK_SHAPE",
    "DRAFT_LAYERS",
    "DRAFT_SEED",
    "LATENT_SHAPES",
    "LLAMA_SHAPE",
    "PROMPTS",
    "SEED",
    "SPECIAL",
    "TOKENIZER_FILES",
    "VOCAB",
    "build_deepseek_model",
    "build_draft_model",
    "build_eagle_head",
    "build_model",
    "build_tokenizer",
    "hf_greedy",
    "prompt_ids",
]

#: The tiny Llama's shape, shared by the weights built here and the weightless config the args tests use.
LLAMA_SHAPE = llama.llama_shape(num_attention_heads=4, num_key_value_heads=2)


# SGLang's EAGLE head (``sglang.srt.models.llama_eagle``, architecture ``LlamaForCausalLMEagle``) feeds
# ``fc(cat(embed(token), target hidden))`` through its decoder layers, without a final norm; its checkpoint names
# drop the ``model.`` prefix (its ``load_weights`` adds it back). So: one Llama decoder layer of the target's width,
# the embedding and LM head (SGLang's EAGLE worker replaces both with the target's), and ``fc``
# (``2 * hidden -> hidden``, with a bias). HF's reference runs a Llama with its default attention.
_LLAMA = llama.TinyLlama(
    LLAMA_SHAPE,
    eagle_architecture="LlamaForCausalLMEagle",
    eagle_dropped=frozenset({"model.norm.weight"}),
    eagle_fc_bias=True,
)
build_model = _LLAMA.build_model
build_draft_model = _LLAMA.build_draft_model
build_eagle_head = _LLAMA.build_eagle_head
#: HF transformers' greedy continuation of each prompt (float32, batched, left-padded, EOS not special): a Llama
#: with HF's default attention, an MLA model with HF's eager attention (the plainest reference).
hf_greedy = _LLAMA.hf_greedy


#: The tiny DeepSeek-V2's shape (multi-head latent attention, no MoE): every layer a dense MLP. HF's DeepSeek-V2
#: forward wants as many KV heads as query heads; ``moe_layer_freq`` is read by SGLang's ``deepseek_v2.py`` although
#: transformers 5 no longer writes it; ``rope_type: "yarn"`` with factor 1 is plain RoPE, and the only rope SGLang's
#: CPU path takes for this model (``deepseek_yarn``).
DEEPSEEK_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 2,
    "moe_layer_freq": 1,
    "n_routed_experts": 4,  # no layer is a MoE one (first_k_dense_replace), but the config needs the numbers
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "initializer_range": 0.2,  # at the default 0.02 a latent-256 model's greedy ids barely depend on attention
}
#: The two latent shapes the engine tests run: (kv_lora_rank, qk_rope_head_dim).
LATENT_SHAPES = ((32, 16), (256, 32))


def build_deepseek_model(
    out: Path, *, kv_lora_rank: int, qk_rope_head_dim: int, seed: int = SEED, tokenizer_from: Path | None = None
) -> None:
    """Write a seeded random DeepseekV2ForCausalLM (float32, MLA with the given latent shape) and its tokenizer to
    *out* (the tokenizer copied from *tokenizer_from* when given, so a Llama draft built beside it shares it)."""
    import json

    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        build_tokenizer(out, seed)
    else:
        copy_tokenizer(tokenizer_from, out)
    tok = AutoTokenizer.from_pretrained(out)
    config = DeepseekV2Config(
        **DEEPSEEK_SHAPE,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        head_dim=qk_rope_head_dim,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": DEEPSEEK_SHAPE["max_position_embeddings"],
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        },
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    written.setdefault("moe_layer_freq", DEEPSEEK_SHAPE["moe_layer_freq"])
    (out / "config.json").write_text(json.dumps(written, indent=2))
