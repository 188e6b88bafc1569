"""What an attnhost backend factory receives inside an engine: the runner's facts, nothing of the engine.

Both bridges build one per model runner (SGLang) or metadata builder (vLLM)
and pass it as the factory's ``runner`` argument, the
:class:`~attnhost.AttentionRunner` protocol: one factory then serves
attnhost's own runner and every engine alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from attnhost.backend import KVCache

__all__ = ["RunnerView"]


class RunnerView(NamedTuple):
    """An engine runner as an attnhost factory sees it (read-only)."""

    device: torch.device
    dtype: torch.dtype
    is_draft: bool
    kv_pool: KVCache
