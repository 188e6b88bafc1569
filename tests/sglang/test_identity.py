"""A backend is named and fails the same way in both bridges and in attnhost's own runner (``engines.identity``).

The factory-load sentence is the runner's (``... could not be loaded: <cause>; fix or reinstall <distribution>, or
choose another <choice>``): here with SGLang's flag, the draft's own included.
"""

from __future__ import annotations

import pytest

from attnhost import BackendCapabilities, BackendSpec
from attnhost.engines.export import ExportedBackend
from attnhost.engines.identity import BackendIdentity
from attnhost.engines.sglang.adapter import runner_flag
from attnhost.errors import BackendUnavailableError
from attnhost.registry import BackendEntry


def _exported(factory: str, distribution: str | None = "ghost-attn") -> ExportedBackend:
    entry = BackendEntry(BackendSpec(name="ghost", factory=factory), "ghosts", distribution, "1.0")
    return ExportedBackend(entry, engine_name="ghost", aliases=(), overrides=False)


class _DraftRunner:
    is_draft_worker = True


def test_a_factory_that_cannot_be_loaded_is_one_sentence_naming_the_flag_that_chose_it() -> None:
    flag = runner_flag(_DraftRunner())
    with pytest.raises(BackendUnavailableError) as caught:
        BackendIdentity.of(_exported("no_such_ghost_kernels:Ghost"), "ghost", "SGLang", flag=flag)
    assert str(caught.value) == (
        "attnhost backend 'ghost' (plugin 'ghosts' (distribution ghost-attn 1.0)), SGLang "
        "--speculative-draft-attention-backend 'ghost' could not be loaded: ModuleNotFoundError: No module named "
        "'no_such_ghost_kernels'; fix or reinstall ghost-attn, or choose another --speculative-draft-attention-backend"
    )


def test_an_in_process_plugin_is_told_to_fix_itself_and_a_broken_declaration_is_named() -> None:
    with pytest.raises(BackendUnavailableError, match=r"\(registered in-process\)\), SGLang --attention-backend "):
        BackendIdentity.of(_exported("no_such_ghost_kernels:Ghost", None), "ghost", "SGLang")
    with pytest.raises(BackendUnavailableError, match=r"declares no usable capabilities: .*; fix or reinstall ghost"):
        BackendIdentity.of(_exported(f"{__name__}:_Undeclared"), "ghost", "SGLang")


class _Undeclared:
    capabilities = ("flat_heads",)  # not a BackendCapabilities


def test_a_loaded_backend_is_named_as_sglang_names_it() -> None:
    identity = BackendIdentity.of(_exported(f"{__name__}:_Declared"), "attnhost_ghost", "SGLang")
    assert identity.factory is _Declared and identity.capabilities == _Declared.capabilities
    assert identity.where == (
        "attnhost backend 'ghost' (plugin 'ghosts' (distribution ghost-attn 1.0)), SGLang --attention-backend "
        "'attnhost_ghost'"
    )
    assert (
        str(identity.refuse("a feature"))
        == f"{identity.where} does not support a feature; choose another --attention-backend"
    )


class _Declared:
    capabilities = BackendCapabilities(flat_heads=True)
