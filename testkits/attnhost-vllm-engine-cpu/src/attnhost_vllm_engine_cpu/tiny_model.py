"""TEST-ONLY: a tiny Llama-style model, its tokenizer and draft models, made locally and seeded (no download).

The weights are random, so the generated text means nothing; what the tests
compare is token ids, greedy, between HF transformers and vLLM. The
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
#: The tiny Llama's shape: head size 32, the smallest vLLM's ``CPU_ATTN`` computes (the all-``CPU_ATTN`` reference
#: runs need it), and grouped queries (two query heads per KV head).
LLAMA_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
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
    """A seeded random EAGLE draft head for *target*, in the layout vLLM's ``EagleLlamaForCausalLM`` loads.

    vLLM's EAGLE head (``vllm.model_executor.models.llama_eagle``) feeds ``fc(cat(embed(token), target hidden))``
    (no bias) through its decoder layers, the first without its input norm, and no final norm; its checkpoint
    names drop the ``model.`` prefix (its ``load_weights`` adds it back). So: one Llama decoder layer of the
    target's width, the embedding, and ``fc`` (``2 * hidden -> hidden``).
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
        architectures=["EagleLlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    body = LlamaForCausalLM(config).to(torch.float32).state_dict()
    hidden = int(LLAMA_SHAPE["hidden_size"])
    dropped = {"model.norm.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"}  # the target's head
    weights = {name.removeprefix("model."): t.contiguous() for name, t in body.items() if name not in dropped}
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    save_file(weights, str(out / "model.safetensors"))
    config.save_pretrained(out)


def prompt_ids(model_dir: Path) -> list[list[int]]:
    """The prompts as token ids, with the BOS id first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (float32, eager attention, batched, left-padded, EOS not
    special)."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
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
