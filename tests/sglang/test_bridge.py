"""The SGLang bridge as SGLang itself drives it: its plugin loader, argument parser, resolution and draft resolver.

Every scenario is a fresh SGLang process (``probe_sglang.py``), because
SGLang loads plugins once per process and ``sglang serve`` starts from
nothing. Third-party plugins are real distributions on ``PYTHONPATH``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_probe
from distgen import make_dist

ACME = '''
"""A third-party plugin: implements declared-only 'flashinfer', declares 'acme_declared', answers the fallback."""
from attnhost import BackendSpec, hookimpl


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(
            name="flashinfer",
            factory="acme_attn.kernels:AcmeAttention",
            platforms=("cpu", "cuda"),
            requires=("torch",),
            description="acme's flashinfer",
        ),
        BackendSpec(name="acme_declared", description="declared only: no implementation installed"),
    ]


@hookimpl
def attnhost_draft_attention_backends():
    return ["flashinfer"]


@hookimpl
def attnhost_draft_fallback(platform):
    return "flashinfer" if platform == "cpu" else None
'''

ACME_KERNELS = '''
"""acme's kernel: a real implementation (attnhost's torch_native math under another name)."""
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class AcmeAttention(TorchNativeAttnBackend):
    """acme attention (test plugin)."""
'''


def _args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model-path", str(model_dir), "--device", "cpu", "--skip-tokenizer-init", *extra]


def _messages(report: dict[str, Any], level: str) -> list[str]:
    return [r["message"] for r in report["logs"] if r["level"] == level and r["logger"].startswith("attnhost")]


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> dict[str, Any]:
    """attnhost, the built-in plugin and the two examples, as the sglang environment installs them."""
    return run_probe(
        {
            "server_args": [
                _args(model_dir, "--attention-backend", "tiny", "--speculative-draft-attention-backend", "tiny"),
                _args(model_dir, "--attention-backend", "batched_matmul"),
                _args(model_dir, "--attention-backend", "torch_native"),
                _args(model_dir, "--attention-backend", "triton"),
                _args(
                    model_dir,
                    "--attention-backend",
                    "triton",
                    "--speculative-draft-attention-backend",
                    "tiny",
                ),
                _args(model_dir, "--attention-backend", "attnhost_torch_native"),
                _args(model_dir, "--attention-backend", "batched_matmul", "--speculative-algorithm", "NGRAM"),
                *(
                    _args(
                        model_dir,
                        "--attention-backend",
                        "batched_matmul",
                        "--speculative-algorithm",
                        algorithm,
                        "--speculative-draft-model-path",
                        str(model_dir),
                    )
                    for algorithm in ("EAGLE", "FROZEN_KV_MTP")
                ),
            ],
            "late": True,
            "spawn": True,
        }
    )


def test_sglangs_plugin_loader_registers_every_implemented_available_backend(plain: dict[str, Any]) -> None:
    assert plain["sglang_modules_after_import_attnhost"] == []
    assert plain["attnhost_factories"] == ["attnhost_torch_native", "batched_matmul", "cpu_paged", "tiny"]
    for name in ("attnhost_torch_native", "batched_matmul", "cpu_paged", "tiny"):
        assert plain["choices"].count(name) == 1
    # draft-capable ones (the examples declare themselves so) join SGLang's draft list; torch_native does not
    assert [n for n in plain["draft_choices"] if n in plain["attnhost_factories"]] == [
        "batched_matmul",
        "cpu_paged",
        "tiny",
    ]
    # declared-only attnhost names add nothing: SGLang's own names stay SGLang's, nothing new appears
    assert "acme_declared" not in plain["all_backends"]
    infos = _messages(plain, "INFO")
    assert sum("registered 4 SGLang attention backend(s)" in m for m in infos) == 1, infos


def test_a_name_sglang_implements_keeps_sglangs_and_warns_once(plain: dict[str, Any]) -> None:
    assert "torch_native" not in plain["attnhost_factories"]
    warnings = [m for m in _messages(plain, "WARNING") if "'attnhost_torch_native'" in m]
    assert len(warnings) == 1 and "SGLang implements 'torch_native' itself and keeps it" in warnings[0]
    assert "ATTNHOST_SGLANG_OVERRIDE=torch_native" in warnings[0]


def test_prepare_server_args_and_resolve_once_with_a_plugin_backend(plain: dict[str, Any]) -> None:
    tiny = plain["resolved"][0]
    assert tiny["attention_backend"] == "tiny"
    assert tiny["speculative_draft_attention_backend"] == "tiny"
    # SGLang's own draft resolver takes the explicitly named plugin backend
    assert tiny["draft_worker_backend"] == "tiny"


def test_cuda_graphs_are_switched_off_for_an_adapter_without_graph_support(plain: dict[str, Any]) -> None:
    tiny, batched, _, triton, _, torch_native, *_ = plain["resolved"]
    assert (torch_native["cuda_graph_decode"], torch_native["cuda_graph_prefill"]) == ("disabled", "disabled")
    assert triton["cuda_graph_decode"] != "disabled"  # SGLang's own backend keeps its graphs: the hook did it
    # SGLang reconfigures logging while it resolves arguments, so these lines are read from the process's stderr
    assert (
        "CUDA graph is disabled because attnhost backend(s) attnhost_torch_native declare no CUDA-graph support"
        in plain["stderr"]
    )
    # a graph-capable one keeps SGLang's decode graphs, never its prefill graphs
    for graphs in (batched, tiny):
        assert (graphs["cuda_graph_decode"], graphs["cuda_graph_prefill"]) == ("full", "disabled"), graphs
    assert "Prefill CUDA graphs are disabled for attnhost backend(s) batched_matmul" in plain["stderr"]


def test_speculative_runs_keep_the_decode_graphs_attnhost_captures(plain: dict[str, Any]) -> None:
    """NGRAM and EAGLE: the target's verify graphs and EAGLE's draft-decode graphs run through the adapter
    (tests/sglang/test_spec_graphs.py), so SGLang's decode-phase graphs stay on; an algorithm whose graph runners
    attnhost does not drive (frozen-KV MTP brings its own) gets them off, in one line naming it."""
    ngram, eagle, frozen = plain["resolved"][6:]
    for graphs in (ngram, eagle):
        assert (graphs["cuda_graph_decode"], graphs["cuda_graph_prefill"]) == ("full", "disabled"), graphs
    assert (frozen["cuda_graph_decode"], frozen["cuda_graph_prefill"]) == ("disabled", "disabled"), frozen
    assert (
        "CUDA graph is disabled for attnhost backend(s) batched_matmul in FROZEN_KV_MTP speculative decoding: "
        "attnhost captures the graphs of plain decoding and of EAGLE, EAGLE3, NGRAM, STANDALONE"
    ) in plain["stderr"]


def test_a_draft_only_attnhost_backend_is_weighed_too(plain: dict[str, Any]) -> None:
    """SGLang's own target with an attnhost draft: the draft's graph support decides, as the target's would."""
    draft = plain["resolved"][4]
    assert (draft["attention_backend"], draft["draft_worker_backend"]) == ("triton", "tiny")
    assert (draft["cuda_graph_decode"], draft["cuda_graph_prefill"]) == ("full", "disabled"), draft
    # the bridge weighed the draft: tiny is named by two resolutions, the tiny target's and this one's
    lines = [line for line in plain["stderr"].splitlines() if "Prefill CUDA graphs are disabled" in line]
    assert sum(line.endswith("attnhost backend(s) tiny (decode-phase graphs only)") for line in lines) == 2, lines


def test_sglangs_draft_resolver_inherits_a_draft_capable_plugin_backend(plain: dict[str, Any]) -> None:
    batched = plain["resolved"][1]
    assert batched["speculative_draft_attention_backend"] is None
    assert batched["draft_worker_backend"] == "batched_matmul"


def test_sglangs_own_fallback_rule_stays_without_a_third_party_answer(plain: dict[str, Any]) -> None:
    torch_native = plain["resolved"][2]
    assert torch_native["draft_worker_backend"] == "flashinfer"  # SGLang's rule on a non-ROCm platform


def test_a_late_registration_after_resolution_raises(plain: dict[str, Any]) -> None:
    assert plain["late"] is not None
    assert plain["late"].startswith("RegistryFrozenError: add_attention_backend_choices(['late_backend'])")
    assert "SGLang's server-argument resolution" in plain["late"]


def test_a_spawned_process_sees_the_same_registration(plain: dict[str, Any]) -> None:
    child = plain["spawned"]
    assert child["attnhost_factories"] == plain["attnhost_factories"]
    assert [n for n in child["draft_choices"] if n in child["attnhost_factories"]] == [
        "batched_matmul",
        "cpu_paged",
        "tiny",
    ]


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("acme-site")
    make_dist(
        root,
        "acme-attn",
        "2.0",
        {"sglang.draft_attention_backends": {"acme": "acme_attn"}},
        modules={"acme_attn": ACME, "acme_attn.kernels": ACME_KERNELS},
    )
    report = run_probe(
        {"server_args": [_args(model_dir, "--attention-backend", "torch_native")]},
        path_entries=[root],
    )
    return root, report


def test_a_plugin_implementing_an_sglang_name_is_renamed_not_a_takeover(acme: tuple[Path, dict[str, Any]]) -> None:
    _, report = acme
    assert "flashinfer" not in report["attnhost_factories"]  # SGLang's own flashinfer stays
    assert "attnhost_flashinfer" in report["attnhost_factories"]
    assert "attnhost_flashinfer" in report["draft_choices"]
    assert "acme_declared" not in report["all_backends"] and "acme_declared" not in report["choices"]
    warnings = [m for m in _messages(report, "WARNING") if "'attnhost_flashinfer'" in m]
    assert len(warnings) == 1 and "plugin 'acme'" in warnings[0]


def test_a_third_party_draft_fallback_wins_inside_sglang(acme: tuple[Path, dict[str, Any]]) -> None:
    _, report = acme
    assert report["resolved"][0]["draft_worker_backend"] == "attnhost_flashinfer"


def test_the_override_opt_in_replaces_sglangs_implementation(
    acme: tuple[Path, dict[str, Any]], model_dir: Path
) -> None:
    root, _ = acme
    report = run_probe({}, path_entries=[root], env={"ATTNHOST_SGLANG_OVERRIDE": "flashinfer"})
    assert "flashinfer" in report["attnhost_factories"] and "attnhost_flashinfer" not in report["attnhost_factories"]
    assert any("replaces SGLang's own 'flashinfer'" in m for m in _messages(report, "WARNING"))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({"ATTNHOST_DISABLE_PLUGIN_AUTOLOAD": "1"}, ["attnhost_torch_native"], id="autoload-off"),
        pytest.param({"ATTNHOST_PLUGINS": "tiny"}, ["attnhost_torch_native", "tiny"], id="attnhost-allow-list"),
        pytest.param({"SGLANG_PLUGINS": "someone_else"}, [], id="sglang-allow-list"),
    ],
)
def test_both_engines_controls_apply(env: dict[str, str], expected: list[str]) -> None:
    assert run_probe({}, env=env)["attnhost_factories"] == expected


def test_an_sglang_outside_the_tested_versions_gets_one_warning_when_it_loads_attnhost(tmp_path: Path) -> None:
    """SGLang's own plugin loader runs attnhost's entry point, which says once that this SGLang (here a
    distribution claiming 0.6.1, ahead of the real one on the path) is outside ``attnhost.versions.TESTED``;
    the real 0.5.23 says nothing (the other probes)."""
    make_dist(tmp_path, "sglang", "0.6.1")
    report = run_probe({"server_args": []}, path_entries=[tmp_path])
    warnings = [m for m in _messages(report, "WARNING") if "outside the versions attnhost is tested with" in m]
    assert warnings == [
        "SGLang 0.6.1 (distribution sglang) is outside the versions attnhost is tested with (sglang "
        ">=0.5.22,<=0.5.23); attnhost runs, but if a backend misbehaves, say which versions in the report "
        "(`attnhost versions` lists them)"
    ], warnings


def test_the_installed_sglang_is_inside_the_tested_versions(plain: dict[str, Any]) -> None:
    assert not [m for m in _messages(plain, "WARNING") if "outside the versions attnhost is tested with" in m]
