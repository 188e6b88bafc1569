"""Forward modes, and the one rule mapping a mode to the prefill or decode half, so dispatch and hybrid agree."""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["ForwardMode", "per_mode"]

T = TypeVar("T")


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
        return not self.is_decode_or_idle()

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
        return self is ForwardMode.DRAFT_EXTEND or (include_v2 and self is ForwardMode.DRAFT_EXTEND_V2)

    def is_draft_extend_v2(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND_V2


def per_mode(prefill: T, decode: T, speculative_attention_mode: str) -> tuple[T, ...]:
    """``prefill`` or ``decode`` for every forward mode, by ``int(mode)``: SGLang's ``dispatch_attn_forward_method``."""
    on_decode = {ForwardMode.DECODE, ForwardMode.IDLE}
    if speculative_attention_mode == "decode":
        on_decode |= {ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2}
    return tuple(decode if mode in on_decode else prefill for mode in ForwardMode)
