"""The registry built from the installed built-in plugin: names, roles, aliases, immutability, freeze."""

from __future__ import annotations

import pytest

import attnhost
from attnhost import BackendSpec, RegistryFrozenError, ServerArgs

SGLANG_TARGETS = [
    "triton",
    "torch_native",
    "flex_attention",
    "dsa",
    "qsa",
    "dsv4",
    "fa3",
    "fa4",
    "flashinfer",
    "llada2_cfg_flashinfer",
    "flashmla",
    "trtllm_mla",
    "cutedsl_mla",
    "trtllm_mha",
    "hpc_ops",
    "minicpm_flashattn",
    "minicpm_flashinfer",
    "aiter",
    "wave",
    "intel_amx",
    "ascend",
    "intel_xpu",
]
SGLANG_DRAFT = ["flashinfer", "fa3", "fa4", "triton", "ascend", "trtllm_mha", "intel_xpu"]


def test_builtin_names_are_exactly_sglangs() -> None:
    registry = attnhost.get_registry()
    assert list(registry.names()) == SGLANG_TARGETS
    assert list(registry.names("target")) == SGLANG_TARGETS
    assert sorted(registry.names("draft")) == sorted(SGLANG_DRAFT)


@pytest.mark.parametrize(
    ("alias", "canonical"), [("nsa", "dsa"), ("compressed", "dsv4"), ("tokenspeed_mla", "cutedsl_mla")]
)
def test_deprecated_aliases_resolve_to_canonical_spec(alias: str, canonical: str) -> None:
    registry = attnhost.get_registry()
    assert alias in registry
    assert registry[alias] is registry[canonical]
    assert registry.canonical(alias) == canonical
    assert alias not in registry.names()


def test_every_builtin_declares_platforms_module_and_distribution() -> None:
    registry = attnhost.get_registry()
    for name in registry:
        spec = registry[name]
        entry = registry.entry(name)
        assert entry.plugin == "builtin" and entry.distribution == "attnhost"
        assert spec.requires and spec.provided_by and spec.description, name
        if name != "torch_native":
            assert spec.platforms, name
            assert not spec.implemented, f"{name} must be declared-only, not faked"
    assert registry["torch_native"].implemented
    assert "decode-only dense-MQA" in registry["trtllm_mha"].description
    assert registry["flashinfer"].requires == ("flashinfer",)
    assert registry["flashinfer"].provided_by == "flashinfer-python"


def test_unknown_name_lookup_suggests() -> None:
    registry = attnhost.get_registry()
    assert "flashinfr" not in registry
    with pytest.raises(attnhost.UnknownBackendError, match="did you mean 'flashinfer'"):
        registry["flashinfr"]


def test_views_are_read_only_and_current() -> None:
    choices = attnhost.ATTENTION_BACKEND_CHOICES
    assert list(choices) == SGLANG_TARGETS
    assert "triton" in choices and len(choices) == len(SGLANG_TARGETS)
    with pytest.raises(TypeError, match="read-only"):
        choices.append("mine")  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="add_draft_attention_backend_choices"):
        attnhost.DRAFT_ATTENTION_BACKEND_CHOICES.extend(["mine"])  # type: ignore[attr-defined]
    registry = attnhost.get_registry()
    with pytest.raises(AttributeError):
        registry.names().append("x")  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        registry.aliases()["x"] = "y"  # type: ignore[index]
    attnhost.add_attention_backend_choices(["vendor_a"])
    assert "vendor_a" in choices and choices[-1] == "vendor_a"


def test_add_choices_before_freeze_work_as_in_sglang() -> None:
    attnhost.add_attention_backend_choices(["vendor_a"])
    attnhost.add_draft_attention_backend_choices(["vendor_a", "vendor_b"])
    registry = attnhost.get_registry()
    assert "vendor_a" in registry.names() and "vendor_b" in registry.names()
    assert registry.is_draft_capable("vendor_a") and registry.is_draft_capable("vendor_b")
    assert not registry["vendor_a"].implemented  # name-only: declared, not faked
    assert registry.entry("vendor_a").distribution is None
    args = ServerArgs(speculative_draft_attention_backend="vendor_b")
    assert args.speculative_draft_attention_backend == "vendor_b"


def test_first_server_args_freezes_every_registration_path() -> None:
    ServerArgs()
    with pytest.raises(RegistryFrozenError, match=r"\['late_one'\].*entry point"):
        attnhost.add_attention_backend_choices(["late_one"])
    with pytest.raises(RegistryFrozenError, match="late_draft"):
        attnhost.add_draft_attention_backend_choices(["late_draft"])

    class LatePlugin:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name="late_plugin_backend")]

    with pytest.raises(RegistryFrozenError, match="late"):
        attnhost.register_plugin(LatePlugin(), name="late")
    with pytest.raises(RegistryFrozenError, match="late2"):
        attnhost.get_plugin_manager().register(LatePlugin(), name="late2")
    registry = attnhost.get_registry()
    assert "late_one" not in registry and "late_plugin_backend" not in registry
    assert attnhost.get_registry() is registry  # nothing rebuilt, nothing lost


def test_in_process_plugin_before_freeze() -> None:
    class Vendor:
        @attnhost.hookimpl
        def attnhost_attention_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name="vendor", factory="vendor_mod:Backend", aliases=("v",), platforms=("cuda",))]

        @attnhost.hookimpl
        def attnhost_draft_attention_backends(self) -> list[str]:
            return ["v"]

    attnhost.register_plugin(Vendor(), name="vendor-plugin")
    registry = attnhost.get_registry()
    assert registry.canonical("v") == "vendor"
    assert registry.is_draft_capable("vendor")
    assert registry.entry("vendor").plugin == "vendor-plugin"


def test_in_process_plugin_with_unknown_hook_is_refused() -> None:
    class Typo:
        @attnhost.hookimpl
        def attnhost_attention_backend(self) -> list[BackendSpec]:
            return []

    with pytest.raises(attnhost.InvalidPluginError, match="did you mean 'attnhost_attention_backends'"):
        attnhost.register_plugin(Typo(), name="typo")
    attnhost.get_plugin_manager().check_pending()  # nothing half-registered is left behind


def test_spec_validation_and_lazy_factory() -> None:
    spec = BackendSpec(name="lazy", factory="module_that_does_not_exist:Factory")
    assert spec.implemented and spec.factory_module == "module_that_does_not_exist"
    with pytest.raises(ModuleNotFoundError):
        spec.load()
    for bad in ("", "bad name!", " lead"):
        with pytest.raises(ValueError, match="invalid backend name"):
            BackendSpec(name=bad)
    with pytest.raises(ValueError, match="factory"):
        BackendSpec(name="x", factory=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a 'module:attr'"):
        BackendSpec(name="x", factory="not a module")
    assert BackendSpec(name="x", aliases=["y"], platforms="CUDA").platforms == ("cuda",)  # type: ignore[arg-type]
