"""A spawned process that receives a config naming an attnhost backend gets that backend.

vLLM passes its ``VllmConfig`` to the EngineCore and worker processes it
spawns; the child unpickles it before any plugin loads. ``AttentionBackendEnum``
members pickle by value, so a member added at run time the plain way is unknown
there (the negative control below shows vLLM's failure). attnhost's members
carry a value that registers attnhost's backends while it is unpickled.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from attnhost_vllm_cpu.config import engine_config as vllm_engine_config
from attnhost_vllm_cpu.spawn import spawned
from attnhost_vllm_cpu.spawn_child import report
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend


@pytest.fixture(scope="module")
def engine_config(tiny_model: str) -> Any:
    """A VllmConfig built the way `vllm serve` builds it: vLLM's own parser, EngineArgs, create_engine_config."""
    return vllm_engine_config(tiny_model, "torch_native", draft_backend="tiny")


def test_cli_resolves_to_the_adapter_classes(engine_config: Any) -> None:
    assert engine_config.attention_config.backend is AttentionBackendEnum.TORCH_NATIVE
    assert engine_config.speculative_config.attention_backend is AttentionBackendEnum.TINY
    cls = engine_config.attention_config.backend.get_class()
    assert (cls.__module__, cls.__qualname__) == ("attnhost.engines.vllm.backends", "TORCH_NATIVE")
    assert cls.get_name() == "TORCH_NATIVE" and cls.identity.attnhost_name == "torch_native"


PROBE = "ATTNHOST_SPAWN_PROBE"


@pytest.fixture(scope="module")
def child_report(engine_config: Any) -> dict[str, Any]:
    """One spawned process (vLLM's start method for EngineCore and workers) given the config and some members."""
    if PROBE not in AttentionBackendEnum.__members__:
        # the plain way every out-of-tree backend registers today: a str class path
        register_backend(PROBE, "attnhost_tiny.TinyAttnBackend")
    names = ("TINY", "BATCHED_MATMUL", "TORCH_NATIVE", "TORCH_NATIVE_MLA", PROBE)
    return spawned(report, engine_config, [pickle.dumps(AttentionBackendEnum[name]) for name in names])


def test_spawned_engine_process_gets_the_backends(child_report: dict[str, Any]) -> None:
    assert {key: value for key, value in child_report.items() if key != "members"} == {
        "plugins_loaded_before": False,
        "target": "TORCH_NATIVE",
        "draft": "TINY",
        "target_cls": "attnhost.engines.vllm.backends.TORCH_NATIVE",
        "draft_cls": "attnhost.engines.vllm.backends.TINY",
        "target_impl": "TORCH_NATIVE.Impl",
        "identity": "torch_native",
        "draft_identity": "tiny",
    }


def test_each_name_survives_the_pickle_as_itself(child_report: dict[str, Any]) -> None:
    """One class path per name: TINY and BATCHED_MATMUL do not alias each other across the pickle, nor does a
    backend's MLA name alias its dense one."""
    assert child_report["members"][:4] == ["TINY", "BATCHED_MATMUL", "TORCH_NATIVE", "TORCH_NATIVE_MLA"]


def test_the_trap_a_plainly_registered_member_does_not_survive(child_report: dict[str, Any]) -> None:
    """Negative control: what a member registered with a plain class path hits in a spawned process."""
    assert child_report["members"][4].startswith(
        "ValueError: 'attnhost_tiny.TinyAttnBackend' is not a valid AttentionBackendEnum"
    )
