"""The engine kit's view of registration (``attnhost_vllm_cpu.registration``), in this process after vLLM's loader.

The suite's registration checks are only as good as these answers: the
member of an exported name, the registry's own message for an unknown name,
the reason for a known one vLLM did not get, and a takeover of one of vLLM's
own backends actually seen (put in place here with vLLM's own override table,
and taken out again).
"""

from __future__ import annotations

import pytest
from attnhost_vllm_cpu.registration import NotInVllmError, UnknownBackendNameError, lookup, takeovers
from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

from attnhost.engines.vllm.bridge import class_path


def test_an_exported_name_and_its_member() -> None:
    backend = lookup("tiny")
    assert (backend.attnhost_name, backend.engine_name, backend.renamed) == ("tiny", "TINY", False)
    assert backend.member is AttentionBackendEnum.TINY and backend.draft
    assert backend.label == "attnhost backend 'tiny' (vLLM TINY)"


def test_an_unknown_name_is_the_registrys_message() -> None:
    with pytest.raises(UnknownBackendNameError, match=r"^unknown attention backend 'tiny_'; did you mean 'tiny'\?$"):
        lookup("tiny_")


def test_a_declared_only_name_says_why_vllm_does_not_have_it() -> None:
    with pytest.raises(NotInVllmError) as info:
        lookup("flashinfer")
    message = str(info.value)
    assert (
        message.startswith("attnhost backend 'flashinfer' (plugin 'builtin'")
        and "is not registered with vLLM: " in message
    )


def test_no_takeover_here_and_one_seen_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    assert takeovers() == {}
    member = AttentionBackendEnum.FLASH_ATTN
    monkeypatch.setitem(_ATTN_OVERRIDES, member, class_path("FLASH_ATTN"))
    assert takeovers() == {"FLASH_ATTN": "attnhost.engines.vllm.backends.FLASH_ATTN"}
