"""TEST-ONLY: a tiny Llama-style model, its tokenizer and draft models, made locally and seeded (no download).

The weights are random, so the generated text means nothing; what the engine tests compare is token ids,
greedy, between HF transformers and the engine. The tokenizer is a byte-level BPE trained here on a seeded
synthetic corpus with exactly ``VOCAB`` entries, so every id the model can produce decodes. Draft models for
speculative decoding (:func:`build_draft_model`) share the target's tokenizer and vocabulary: a smaller random
one (its drafts are mostly rejected, so the output must still equal the target's) or a copy of the target (its
drafts are accepted). The engine kits pass the Llama's shape (:func:`llama_shape`) and their EAGLE head's layout.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DRAFT_LAYERS",
    "DRAFT_SEED",
    "PROMPTS",
    "SEED",
    "SPECIAL",
    "TOKENIZER_FILES",
    "VOCAB",
    "TinyLlama",
    "build_draft_model",
    "build_eagle_head",
    "build_model",
    "build_tokenizer",
    "copy_tokenizer",
    "greedy_continuations",
    "hf_greedy",
    "llama_shape",
    "prompt_ids",
    "write_llama",
]

VOCAB = 1024
SPECIAL = ("<s>", "</s>")
SEED = 1234
PROMPTS = ("The quick brown fox jumps over", "Attention is all")
#: The draft a speculative run gets by default: one layer, other seed (its drafts are mostly wrong).
DRAFT_SEED = 4321
DRAFT_LAYERS = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_SYLLABLES = "ka ri to mu sen la ve on ar qui dex zo pha tri el nu gor bi sa ten mo ul vy ash ren cor ti pa lo ex"
_SYLLABLES += " um ba ne ra sho fi gel dro wen yi tas hol mir kev"


def llama_shape(*, num_attention_heads: int, num_key_value_heads: int) -> dict[str, int]:
    """The tiny Llama's shape (width 64, two layers, ``VOCAB``) with the engine's head counts."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": 512,
    }


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    syllables = _SYLLABLES.split()
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(800)]
    words += " ".join(PROMPTS).lower().split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def build_tokenizer(out: Path, seed: int = SEED) -> None:
    """Train the seeded byte-level BPE (exactly ``VOCAB`` entries, BOS/EOS :data:`SPECIAL`) and save it to *out*."""
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


def copy_tokenizer(source: Path, out: Path) -> None:
    """Copy *source*'s tokenizer files (those of :data:`TOKENIZER_FILES` it has) into *out*, which must exist."""
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)


def build_model(out: Path, shape: Mapping[str, int], seed: int = SEED, *, layers: int | None = None) -> None:
    """Write a seeded random LlamaForCausalLM (float32) of *shape* and its tokenizer to *out*."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, seed)
    write_llama(out, shape, seed, layers=layers)


def write_llama(out: Path, shape: Mapping[str, int], seed: int, *, layers: int | None = None) -> None:
    """Write a seeded random LlamaForCausalLM of *shape* (*layers* of them when given) beside *out*'s tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    dims = dict(shape) if layers is None else {**shape, "num_hidden_layers": layers}
    config = LlamaConfig(
        **dims,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out)


def build_draft_model(
    out: Path, target: Path, shape: Mapping[str, int], *, copy_of_target: bool = False, seed: int = DRAFT_SEED
) -> None:
    """A draft model for *target* (built by :func:`build_model` with *shape*) at *out*, with the target's tokenizer
    and vocabulary.

    ``copy_of_target=True`` copies the target's weights (every draft a greedy target would pick is proposed, so
    drafts are accepted); otherwise a seeded random one-layer Llama of the same width (drafts mostly rejected).
    """
    if copy_of_target:
        shutil.copytree(target, out, dirs_exist_ok=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(target, out)
    write_llama(out, shape, seed, layers=DRAFT_LAYERS)


def build_eagle_head(
    out: Path,
    target: Path,
    shape: Mapping[str, int],
    *,
    architecture: str,
    dropped: Collection[str],
    fc_bias: bool,
    seed: int = DRAFT_SEED,
) -> None:
    """A seeded random EAGLE draft head for *target* (of *shape*) at *out*, in the layout an engine's
    *architecture* loads.

    The head is one Llama decoder layer of the target's width whose checkpoint names drop the ``model.`` prefix,
    less the tensors named in *dropped* (by their ``model.``-prefixed names, e.g. the final norm, or the LM head
    the engine takes from the target), plus ``fc`` (``2 * hidden -> hidden``, with a zero bias if *fc_bias*).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(target, out)
    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        **{**shape, "num_hidden_layers": 1},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        architectures=[architecture],
    )
    torch.manual_seed(seed)
    body = LlamaForCausalLM(config).to(torch.float32).state_dict()
    hidden = int(shape["hidden_size"])
    weights = {name.removeprefix("model."): t.contiguous() for name, t in body.items() if name not in dropped}
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    if fc_bias:
        weights["fc.bias"] = torch.zeros(hidden)
    save_file(weights, str(out / "model.safetensors"))
    config.save_pretrained(out)


def prompt_ids(model_dir: Path) -> list[list[int]]:
    """The prompts as token ids, with the BOS id first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, *, eager_llama: bool = False
) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (float32, batched, left-padded, EOS not special).

    A Llama runs with HF's default attention unless *eager_llama*; any other model (an MLA one) with HF's eager
    attention, the plainest reference.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if AutoConfig.from_pretrained(model_dir).model_type == "llama":
        eager = {"attn_implementation": "eager"} if eager_llama else {}
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **eager).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return greedy_continuations(model, prompts, new_tokens)


def greedy_continuations(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """*model*'s greedy continuation of each prompt, in one left-padded batch (pad id 0, masked; EOS not special)."""
    import torch
    from transformers import GenerationConfig

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


@dataclass(frozen=True)
class TinyLlama:
    """One engine's tiny Llama: its *shape* (:func:`llama_shape`), its EAGLE head's layout (the *eagle_architecture*
    it loads, the *eagle_dropped* tensors, whether ``fc`` has a bias) and whether HF's reference for it runs eager
    attention. An engine kit binds these methods as its module's builders."""

    shape: Mapping[str, int]
    eagle_architecture: str
    eagle_dropped: frozenset[str]
    eagle_fc_bias: bool
    eager_llama: bool = False

    def build_model(self, out: Path, seed: int = SEED, *, layers: int | None = None) -> None:
        """Write a seeded random LlamaForCausalLM (float32) and its tokenizer to *out*."""
        build_model(out, self.shape, seed, layers=layers)

    def build_draft_model(
        self, out: Path, target: Path, *, copy_of_target: bool = False, seed: int = DRAFT_SEED
    ) -> None:
        """A draft model for *target* (built by :meth:`build_model`) at *out*, with the target's tokenizer and
        vocabulary.

        ``copy_of_target=True`` copies the target's weights (every draft a greedy target would pick is proposed, so
        drafts are accepted); otherwise a seeded random one-layer Llama of the same width (drafts mostly rejected).
        """
        build_draft_model(out, target, self.shape, copy_of_target=copy_of_target, seed=seed)

    def build_eagle_head(self, out: Path, target: Path, seed: int = DRAFT_SEED) -> None:
        """A seeded random EAGLE draft head for *target* at *out*, in the layout the engine's architecture loads
        (see :func:`build_eagle_head`)."""
        build_eagle_head(
            out,
            target,
            self.shape,
            architecture=self.eagle_architecture,
            dropped=self.eagle_dropped,
            fc_bias=self.eagle_fc_bias,
            seed=seed,
        )

    def hf_greedy(self, model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """HF transformers' greedy continuation of each prompt (see :func:`hf_greedy`)."""
        return hf_greedy(model_dir, prompts, new_tokens, eager_llama=self.eager_llama)
