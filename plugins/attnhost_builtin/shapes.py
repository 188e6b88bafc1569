"""The built-in backend's per-layer shape checks: every tensor a layer hands over, against the layer and the batch,
before anything is written.

A tensor of the right element count and the wrong shape would otherwise be reinterpreted by a view (a decode
``q`` of ``[4, 8, 32]`` read as two tokens of 16 heads) and its output or its cache rows silently wrong. Tuple
comparisons only: no device read, nothing allocated, so the check stays on the per-layer path.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["check_rows"]


def check_rows(name: str, tensor: Tensor, tokens: int, heads: int, dim: int, layer_id: int) -> None:
    """``tensor`` is ``[tokens, heads, dim]`` or its flat ``[tokens, heads * dim]``, else one sentence says which
    shape it has and which the layer and the batch expect."""
    shape = tuple(tensor.shape)
    if shape == (tokens, heads, dim) or shape == (tokens, heads * dim):
        return
    raise ValueError(
        f"torch_native: {name} of shape {list(shape)} for layer {layer_id}, whose batch brings {tokens} new tokens "
        f"and whose {name} has {heads} heads of {dim}: expected [{tokens}, {heads}, {dim}] (or flat [{tokens}, "
        f"{heads * dim}]); nothing was read or written — fix the caller's shapes"
    )
