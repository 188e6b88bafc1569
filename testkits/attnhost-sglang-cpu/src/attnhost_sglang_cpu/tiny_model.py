"""TEST-ONLY: a tiny Llama-style model, its tokenizer and draft models, made locally and seeded (no download).

The weights are random, so the generated text means nothing; what the tests
compare is token ids, greedy, between HF transformers and SGLang. The
tokenizer is a byte-level BPE trained here on a seeded synthetic corpus with
exactly ``VOCAB`` entries, so every id the model can produce decodes.
Draft models for speculative decoding (:func:`build_draft_model`) share the
target's tokenizer and vocabulary: a smaller random one (its drafts are mostly
rejected, so the output must still equal the target's) or a copy of the target
(its drafts are accepted).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

VOCAB = 1024
SPECIAL = ("<s>", "</s>")
SEED = 1234
PROMPTS = ("The quick brown fox jumps over", "Attention is all")
#: The tiny Llama's shape, shared by the weights built here and the weightless config the args tests use.
LLAMA_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

_SYLLABLES = "ka ri to mu sen la ve on ar qui dex zo pha tri el nu gor bi sa ten mo ul vy ash ren cor ti pa lo ex"
_SYLLABLES += " um ba ne ra sho fi gel dro wen yi tas hol mir kev"


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    syllables = _SYLLABLES.split()
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(800)]
    words += " ".join(PROMPTS).lower().split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def build_tokenizer(out: Path, seed: int = SEED) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} entries, expected {VOCAB}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[1])
    fast.save_pretrained(out)


def build_model(out: Path, seed: int = SEED, *, layers: int | None = None) -> None:
    """Write a seeded random LlamaForCausalLM (float32) and its tokenizer to *out*."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, seed)
    _write_llama(out, seed, layers=layers)


def _write_llama(out: Path, seed: int, *, layers: int | None = None) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    shape = dict(LLAMA_SHAPE) if layers is None else {**LLAMA_SHAPE, "num_hidden_layers": layers}
    config = LlamaConfig(
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)


#: The draft a speculative run gets by default: one layer, other seed (its drafts are mostly wrong).
DRAFT_SEED = 4321
DRAFT_LAYERS = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_draft_model(out: Path, target: Path, *, copy_of_target: bool = False, seed: int = DRAFT_SEED) -> None:
    """A draft model for *target* (built by :func:`build_model`) at *out*, with the target's tokenizer and vocabulary.

    ``copy_of_target=True`` copies the target's weights (every draft a greedy target would pick is proposed, so
    drafts are accepted); otherwise a seeded random one-layer Llama of the same width (drafts mostly rejected).
    """
    if copy_of_target:
        shutil.copytree(target, out, dirs_exist_ok=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy2(target / name, out / name)
    _write_llama(out, seed, layers=DRAFT_LAYERS)


def build_eagle_head(out: Path, target: Path, seed: int = DRAFT_SEED) -> None:
    """A seeded random EAGLE draft head for *target*, in the layout SGLang's ``LlamaForCausalLMEagle`` loads.

    SGLang's EAGLE head (``sglang.srt.models.llama_eagle``) feeds ``fc(cat(embed(token), target hidden))`` through
    its decoder layers, without a final norm; its checkpoint names drop the ``model.`` prefix (its
    ``load_weights`` adds it back). So: one Llama decoder layer of the target's width, the embedding and LM head
    (SGLang's EAGLE worker replaces both with the target's), and ``fc`` (``2 * hidden -> hidden``).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy2(target / name, out / name)
    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        **{**LLAMA_SHAPE, "num_hidden_layers": 1},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        architectures=["LlamaForCausalLMEagle"],
    )
    torch.manual_seed(seed)
    body = LlamaForCausalLM(config).to(torch.float32).state_dict()
    hidden = int(LLAMA_SHAPE["hidden_size"])
    weights = {name.removeprefix("model."): t.contiguous() for name, t in body.items() if name != "model.norm.weight"}
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    weights["fc.bias"] = torch.zeros(hidden)
    save_file(weights, str(out / "model.safetensors"))
    config.save_pretrained(out)


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
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copy2(tokenizer_from / name, out / name)
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


def prompt_ids(model_dir: Path) -> list[list[int]]:
    """The prompts as token ids, with the BOS id first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (float32, batched, left-padded, EOS not special)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

    if AutoConfig.from_pretrained(model_dir).model_type == "llama":
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:  # HF's eager attention: the plainest reference for an MLA model
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    width = max(map(len, prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=pad
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return [row[width:].tolist() for row in out]
