"""TEST-ONLY: a tiny random DFlash draft for the kit's Llama, and a plain-torch reference of what it proposes.

SGLang's DFLASH worker (``sglang.srt.speculative.dflash_worker_v2``) drafts a
whole block at once: the block is the last accepted ("bonus") token followed by
mask tokens, embedded with the *target's* embedding, run through the draft's
layers (``sglang.srt.models.dflash.DFlashDraftModel``, Qwen3-style layers with
q/k norms), whose keys and values are the block's own plus, for every
committed token, K/V projected from the target's hidden state after layer
``target_layer_ids`` (``fc`` and ``hidden_norm``, then each layer's k/v
projection, k norm and RoPE). The draft's last hidden states go through the
target's LM head; position ``i >= 1`` of the block proposes token ``i``.

Which keys a block token sees is the attention variant under test:
``full_attention`` layers are non-causal (SGLang's ``ENCODER_ONLY``) unless
the config says ``is_causal: true``; ``sliding_attention`` layers are causal
within ``sliding_window`` (HF's ``W``, SGLang's ``W - 1``).

:func:`build_dflash_draft` writes such a draft (a checkpoint SGLang loads as
``DFlashDraftModel``); :func:`reference_verify_rows` replays DFLASH's greedy
rounds in float64 from HF transformers' hidden states, so a test can compare
every verify block the engine ran (draft proposals included) with the
definition, independently of any attention kernel. A 2-layer target offers its
layer 0 only: SGLang captures "before layer ``i + 1``", and there is no layer 2.
The tiny tokenizer has no ``<|MASK|>``, so ``dflash_config.mask_token_id`` names
one of its ids.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnhost_sglang_cpu.tiny_model import LLAMA_SHAPE, TOKENIZER_FILES

#: The verify block (bonus token + proposals): SGLang's ``--speculative-num-draft-tokens`` for DFLASH.
BLOCK_SIZE = 4
#: The id the block's masked positions carry (the tiny tokenizer has no ``<|MASK|>``).
MASK_TOKEN_ID = 5
#: The only target layer whose output a 2-layer target can hand over (captured before layer 1).
TARGET_LAYER_IDS = (0,)
DRAFT_SEED = 2468
#: Large enough that the draft's attention, not its input embedding, decides what it proposes.
INIT_RANGE = 0.2
ROPE_THETA = 10000.0
RMS_EPS = 1e-6


@dataclass(frozen=True)
class DraftKind:
    """One DFlash draft configuration: its layers' types, ``is_causal`` (``None``: unset) and HF window."""

    name: str
    layer_types: tuple[str, ...] = ("full_attention",)
    is_causal: bool | None = None
    sliding_window: int | None = None  # HF's W: a query sees W keys, itself included

    def attention(self, layer: int) -> tuple[bool, int]:
        """SGLang's reading of layer *layer*: (causal, window_left), as ``sglang.srt.models.dflash`` does."""
        sliding = self.layer_types[layer] == "sliding_attention"
        causal = self.is_causal if self.is_causal is not None else sliding
        window = (self.sliding_window or 0) - 1 if sliding else -1
        return causal, window


#: The default DFlash draft (non-causal block attention), an explicitly causal one, and a sliding-window one
#: (a causal window layer under a non-causal full layer).
DRAFT_KINDS = {
    "noncausal": DraftKind("noncausal"),
    "causal": DraftKind("causal", is_causal=True),
    "sliding": DraftKind("sliding", ("sliding_attention", "full_attention"), sliding_window=3),
}


def build_dflash_draft(out: Path, target: Path, kind: DraftKind, *, seed: int = DRAFT_SEED) -> None:
    """Write a seeded random DFlash draft for the tiny target at *target* (its tokenizer copied) to *out*."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy2(target / name, out / name)
    hidden = int(LLAMA_SHAPE["hidden_size"])
    heads, kv_heads = int(LLAMA_SHAPE["num_attention_heads"]), int(LLAMA_SHAPE["num_key_value_heads"])
    head_dim, inter = hidden // heads, int(LLAMA_SHAPE["intermediate_size"])
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": len(kind.layer_types),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "max_position_embeddings": int(LLAMA_SHAPE["max_position_embeddings"]),
        "vocab_size": int(LLAMA_SHAPE["vocab_size"]),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "layer_types": list(kind.layer_types),
        "block_size": BLOCK_SIZE,
        "dflash_config": {
            "mask_token_id": MASK_TOKEN_ID,
            "target_layer_ids": list(TARGET_LAYER_IDS),
            "num_target_layers": int(LLAMA_SHAPE["num_hidden_layers"]),
            "block_size": BLOCK_SIZE,
        },
    }
    if kind.sliding_window is not None:  # Qwen3Config drops sliding_window unless use_sliding_window is set
        config |= {"sliding_window": kind.sliding_window, "use_sliding_window": True}
    if kind.is_causal is not None:
        config["is_causal"] = kind.is_causal
    (out / "config.json").write_text(json.dumps(config, indent=2))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * INIT_RANGE).contiguous()

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=gen)).contiguous()

    weights: dict[str, torch.Tensor] = {}
    for i in range(len(kind.layer_types)):
        p = f"layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": norm(hidden),
            f"{p}.post_attention_layernorm.weight": norm(hidden),
            f"{p}.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{p}.self_attn.q_norm.weight": norm(head_dim),
            f"{p}.self_attn.k_norm.weight": norm(head_dim),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter),
        }
    weights["norm.weight"] = norm(hidden)
    weights["fc.weight"] = rand(hidden, hidden * len(TARGET_LAYER_IDS))
    weights["hidden_norm.weight"] = norm(hidden)
    save_file(weights, str(out / "model.safetensors"))


# -- the plain reference -------------------------------------------------------------------------------------------


def reference_verify_rows(
    target: Path, draft: Path, kind: DraftKind, prompts: list[list[int]], target_ids: list[list[int]]
) -> list[list[tuple[int, list[int]]]]:
    """Per prompt, every DFLASH verify block the engine must run: ``(committed length, [bonus, proposals...])``.

    Greedy DFLASH with a greedy target: round after round, the block starts at the committed length with the
    bonus token (the target's last pick), the draft proposes the rest, and the target accepts the longest run
    of proposals equal to its own greedy ids (*target_ids*, HF's), plus one bonus token of its own; rounds stop
    once *target_ids* are all out. Computed in float64 from HF transformers' hidden states of the target.
    """
    import torch
    from safetensors.torch import load_file

    model = _hf_model(str(target))
    weights = {k: v.to(torch.float64) for k, v in load_file(str(draft / "model.safetensors")).items()}
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.lm_head.weight.detach()
    rows: list[list[tuple[int, list[int]]]] = []
    for prompt, generated in zip(prompts, target_ids, strict=True):
        context = _target_context(str(target), (*prompt, *generated))
        ctx = _rms(context @ weights["fc.weight"].T, weights["hidden_norm.weight"])
        mine: list[tuple[int, list[int]]] = []
        committed, out = len(prompt), 1  # the prefill's pick is the first bonus token
        while out < len(generated):
            block = [generated[out - 1]] + [MASK_TOKEN_ID] * (BLOCK_SIZE - 1)
            proposals = _propose(weights, kind, embed, lm_head, ctx[:committed], block, committed)
            mine.append((committed, [block[0], *proposals]))
            accepted = 0
            while accepted < len(proposals) and out + accepted < len(generated):
                if proposals[accepted] != generated[out + accepted]:
                    break
                accepted += 1
            committed += accepted + 1
            out += accepted + 1
        rows.append(mine)
    return rows


@functools.cache
def _hf_model(target: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64, attn_implementation="eager").eval()


@functools.cache
def _target_context(target: str, ids: tuple[int, ...]) -> Any:
    """The target's features the draft reads per token: HF's output of each layer in ``TARGET_LAYER_IDS`` (SGLang
    captures the input of layer ``i + 1``, which is HF's ``hidden_states[i + 1]``), concatenated."""
    import torch

    with torch.no_grad():
        states = _hf_model(target)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in TARGET_LAYER_IDS], dim=-1)


def _rms(x: Any, weight: Any) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


def _rope(x: Any, positions: Any) -> Any:
    """Neox-style RoPE over the last dimension of ``[tokens, heads, dim]``."""
    import torch

    dim = x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _propose(
    weights: dict[str, Any], kind: DraftKind, embed: Any, lm_head: Any, ctx: Any, block: list[int], committed: int
) -> list[int]:
    import torch

    heads, kv_heads = int(LLAMA_SHAPE["num_attention_heads"]), int(LLAMA_SHAPE["num_key_value_heads"])
    head_dim = int(LLAMA_SHAPE["hidden_size"]) // heads
    ctx_pos = torch.arange(committed)
    block_pos = torch.arange(committed, committed + len(block))
    x = embed[torch.tensor(block)]
    for i in range(len(kind.layer_types)):
        p = f"layers.{i}"
        causal, window = kind.attention(i)
        h = _rms(x, weights[f"{p}.input_layernorm.weight"])

        def proj(inp: Any, name: str, n: int) -> Any:
            return (inp @ weights[f"{p}.self_attn.{name}.weight"].T).view(-1, n, head_dim)  # noqa: B023

        q = _rope(_rms(proj(h, "q_proj", heads), weights[f"{p}.self_attn.q_norm.weight"]), block_pos)
        k_new = _rope(_rms(proj(h, "k_proj", kv_heads), weights[f"{p}.self_attn.k_norm.weight"]), block_pos)
        k_ctx = _rope(_rms(proj(ctx, "k_proj", kv_heads), weights[f"{p}.self_attn.k_norm.weight"]), ctx_pos)
        keys = torch.cat([k_ctx, k_new]).repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([proj(ctx, "v_proj", kv_heads), proj(h, "v_proj", kv_heads)])
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        key_pos = torch.cat([ctx_pos, block_pos])
        distance = block_pos[:, None] - key_pos[None, :]  # query position minus key position
        seen = torch.ones_like(distance, dtype=torch.bool)
        if causal:
            seen &= distance >= 0
        if window >= 0:
            seen &= distance <= window
        scores = torch.einsum("qhd,khd->hqk", q, keys) * head_dim**-0.5
        probs = scores.masked_fill(~seen[None], float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, values).reshape(len(block), -1)
        x = x + attn @ weights[f"{p}.self_attn.o_proj.weight"].T
        h = _rms(x, weights[f"{p}.post_attention_layernorm.weight"])
        gate, up = h @ weights[f"{p}.mlp.gate_proj.weight"].T, h @ weights[f"{p}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ weights[f"{p}.mlp.down_proj.weight"].T
    hidden = _rms(x, weights["norm.weight"])
    return [int(t) for t in (hidden[1:] @ lm_head.T).argmax(-1)]
