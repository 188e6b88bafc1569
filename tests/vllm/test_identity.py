"""A backend is named and fails the same way in both bridges and in attnhost's own runner (``engines.identity``):
inside vLLM, under its upper-case name, with a way to its twin of the other model kind."""

from __future__ import annotations

import pytest

from attnhost import BackendCapabilities, BackendSpec
from attnhost.engines.export import ExportedBackend
from attnhost.engines.vllm.identity import identify
from attnhost.errors import BackendUnavailableError
from attnhost.registry import BackendEntry


def _exported(factory: str) -> ExportedBackend:
    entry = BackendEntry(BackendSpec(name="ghost", factory=factory), "ghosts", "ghost-attn", "1.0")
    return ExportedBackend(entry, engine_name="GHOST", aliases=(), overrides=False)


class _Declared:
    capabilities = BackendCapabilities(mla=True)


def test_a_factory_that_cannot_be_loaded_is_the_sentence_sglang_and_the_runner_say() -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        identify("GHOST", _exported("no_such_ghost_kernels:Ghost"))
    assert str(caught.value) == (
        "attnhost backend 'ghost' (plugin 'ghosts' (distribution ghost-attn 1.0)), vLLM --attention-backend GHOST "
        "could not be loaded: ModuleNotFoundError: No module named 'no_such_ghost_kernels'; fix or reinstall "
        "ghost-attn, or choose another --attention-backend"
    )


def test_a_loaded_backend_is_named_as_vllm_names_it_and_points_at_its_twin() -> None:
    identity = identify("GHOST_MLA", _exported(f"{__name__}:_Declared"), sibling="GHOST")
    assert identity.factory is _Declared and identity.capabilities.mla
    assert identity.where == (
        "attnhost backend 'ghost' (plugin 'ghosts' (distribution ghost-attn 1.0)), vLLM --attention-backend GHOST_MLA"
    )
    assert identity.sibling_way_out(False) == "select its dense backend, --attention-backend ghost"
