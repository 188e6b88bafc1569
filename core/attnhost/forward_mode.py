"""Forward modes and the one rule that maps a mode to the prefill or decode half.

The rule lives here, once, because both the per-layer dispatch and the hybrid
backend need it and must never disagree about which kernel a forward runs.
"""

from __future__ import annotations

import enum

__all__ = ["ForwardMode", "uses_decode_backend"]


class ForwardMode(enum.IntEnum):
    """What a forward pass does; the names and predicates follow SGLang's."""

    EXTEND = 0
    DECODE = 1
    MIXED = 2
    IDLE = 3
    TARGET_VERIFY = 4
    DRAFT_EXTEND = 5
    DRAFT_EXTEND_V2 = 6

    def is_extend(self) -> bool:
        """True for every mode that runs ``forward_extend`` (new tokens attend causally)."""
        return self in _EXTEND_MODES

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self is ForwardMode.DECODE or self is ForwardMode.IDLE

    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = False) -> bool:
        if include_v2:
            return self is ForwardMode.DRAFT_EXTEND or self is ForwardMode.DRAFT_EXTEND_V2
        return self is ForwardMode.DRAFT_EXTEND

    def is_draft_extend_v2(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND_V2


_EXTEND_MODES = frozenset(
    {
        ForwardMode.EXTEND,
        ForwardMode.MIXED,
        ForwardMode.TARGET_VERIFY,
        ForwardMode.DRAFT_EXTEND,
        ForwardMode.DRAFT_EXTEND_V2,
    }
)


def uses_decode_backend(mode: ForwardMode, speculative_attention_mode: str) -> bool:
    """Whether ``mode`` runs on the decode half of a prefill/decode split.

    Exactly SGLang's ``dispatch_attn_forward_method``: decode and idle use the
    decode backend; target-verify and draft-extend-v2 use it only when
    ``speculative_attention_mode == "decode"``; everything else uses prefill.
    """
    if mode.is_decode_or_idle():
        return True
    if mode.is_target_verify() or mode.is_draft_extend_v2():
        return speculative_attention_mode == "decode"
    return False
