"""The one command, ``pytest --attnhost-backend NAME --attnhost-engine vllm``, as a plugin author runs it.

Each run is a fresh ``pytest`` in an empty directory with this environment's
Python, so it goes through the installed pieces only: attnhost's pytest
plugin, the ``attnhost.engine_suites`` entry point of the installed
``attnhost-vllm-cpu`` kit, and vLLM's own plugin loader. The project's
backends pass every check; a plugin with wrong numerics, installed the way
the plugin guide says, fails with the kit's message naming the case and the
error size; an unknown name fails once with the registry's message.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest
from attnhost_vllm_cpu.forward import BATCHES, BLOCK_SIZES, DTYPES, SHAPES
from attnhost_vllm_cpu.suite import CACHE_CASES as KIT_CACHE_CASES
from attnhost_vllm_cpu.suite import MLA_CASES as KIT_MLA_CASES
from attnhost_vllm_cpu.suite import VARIANT_CASES as KIT_VARIANT_CASES
from distgen import make_dist
from helpers import pytest_command

KIT = "attnhost-vllm-cpu"
#: per backend: registration, name mapping, no takeover, parser/VllmConfig, spawned process (5); the forward
#: matrix, batches x head layouts x block sizes x dtypes; one per vLLM KV-cache layout (6); the MLA cases, skipped
#: for a backend that does not declare mla; the variant cases, skipped for a backend that declares no variant; the
#: FP8 cache cases (vLLM's three FP8 names x batches x block sizes 16 and 32 x dtypes), skipped without FP8 caches;
#: the graph cases (decode and verify, eager and compiled), skipped for a backend that does not declare cuda_graph
GRAPH_CASES = 4
MLA_CASES = len(KIT_MLA_CASES)
VARIANT_CASES = len(KIT_VARIANT_CASES)
CACHE_CASES = len(KIT_CACHE_CASES)
ALL_DTYPES = (
    5
    + len(BATCHES) * len(SHAPES) * len(BLOCK_SIZES) * len(DTYPES)
    + 6
    + MLA_CASES
    + VARIANT_CASES
    + CACHE_CASES
    + GRAPH_CASES
)
MLA_BACKENDS = {"torch_native", "batched_matmul"}  # the project backends that declare mla
VARIANT_BACKENDS = {"torch_native", "batched_matmul"}  # those that declare every variant (the others declare none)
FP8_BACKENDS = {"torch_native", "cpu_paged"}  # those that declare both FP8 caches (the others declare none)
GRAPH_BACKENDS = {"tiny", "batched_matmul", "cpu_paged"}  # those that declare cuda_graph
PROJECT_BACKENDS = ["torch_native", "tiny", "batched_matmul", "cpu_paged"]

WRONG = '''
"""A plugin whose decode is wrong by half: what the kit must catch."""
from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class WrongAttnBackend(TorchNativeAttnBackend):
    """Attention scaled by 1.5 (float32 only)."""

    capabilities = BackendCapabilities(dtypes=("float32",))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache) * 1.5

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache) * 1.5
'''

NO_V_SCALE = '''
"""A plugin that reads pages of 32 and float8_e5m2 caches, but forgets the V scale: what the FP8 cases must catch."""
import dataclasses

from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class NoVScaleBackend(TorchNativeAttnBackend):
    """torch_native with every layer's v_scale taken as 1 (float32 models only)."""

    capabilities = BackendCapabilities(
        dtypes=("float32",), kv_cache_dtypes=("float32", "float8_e5m2"), page_sizes=(32,)
    )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        layer = dataclasses.replace(layer, v_scale=1.0)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        layer = dataclasses.replace(layer, v_scale=1.0)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
'''

WRONG_LATENT = '''
"""A plugin whose MLA absorbed form is wrong by half: what the kit's MLA cases must catch."""
from attnhost import BackendCapabilities
from attnhost_builtin.torch_native import TorchNativeAttnBackend


class WrongLatentBackend(TorchNativeAttnBackend):
    """MLA's absorbed form scaled by 1.5 (float32 only); everything else is torch_native's."""

    capabilities = BackendCapabilities(dtypes=("float32",), mla=True)

    def forward_mla_mqa(self, *args, **kwargs):
        return super().forward_mla_mqa(*args, **kwargs) * 1.5
'''


def kit_env(path_entries: tuple[Path, ...] = ()) -> dict[str, str]:
    """This environment for a pytest run elsewhere: no attnhost settings, this run's PYTHONPATH (the source tree,
    when tests run from it) made absolute, *path_entries* first, and wide lines (pytest cuts summary lines to the
    terminal's width)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    entries = [
        *map(str, path_entries),
        *(str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p),
    ]
    env.update(
        {"PYTHONPATH": os.pathsep.join(entries), "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "COLUMNS": "1000"}
    )
    return env


def one_command(names: list[str], cwd: Path, *extra: str, path_entries: tuple[Path, ...] = ()) -> tuple[int, str]:
    """``python -m pytest --attnhost-backend ... --attnhost-engine vllm EXTRA`` in ``cwd``; exit status and output."""
    args = [arg for name in names for arg in ("--attnhost-backend", name)]
    proc = subprocess.run(
        pytest_command("-rfs", *args, "--attnhost-engine", "vllm", *extra),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=kit_env(path_entries),
        timeout=900,
    )
    return proc.returncode, proc.stdout + proc.stderr


def counts(output: str) -> dict[str, int]:
    """pytest's closing summary as numbers: ``{"passed": 119, "skipped": 0, ...}``."""
    summary = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}


def test_the_kit_is_installed_test_only_with_one_entry_point() -> None:
    kit = importlib.metadata.distribution(KIT)
    assert {(ep.group, ep.name, ep.value) for ep in kit.entry_points} == {
        ("attnhost.engine_suites", "vllm", "attnhost_vllm_cpu.suite")
    }
    assert "TEST-ONLY" in (kit.metadata["Summary"] or "")
    assert kit.requires in (None, [])  # installed --no-deps beside vLLM; it pulls nothing in


def test_installed_it_stays_out_of_every_other_pytest_run(tmp_path: Path) -> None:
    """Installed beside vLLM, the kit (and vLLM) load only when ``--attnhost-engine vllm`` asks for them."""
    (tmp_path / "test_other.py").write_text(
        "import sys\n\n\ndef test_other():\n"
        "    assert not {'attnhost_vllm_cpu', 'vllm'} & set(sys.modules), sorted(sys.modules)\n"
    )
    proc = subprocess.run(
        pytest_command("test_other.py"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=kit_env(),
        timeout=120,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr


def outcomes_by_backend(junit: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Per backend, how many of its cases passed, failed or skipped, from pytest's JUnit report of a run naming
    several backends (each case's id leads with its backend's name: ``test_forward[tiny-decode-...]``)."""
    found: dict[str, dict[str, int]] = {name: {} for name in names}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        backend = re.split(r"[-\]]", case.get("name", "").partition("[")[2], maxsplit=1)[0]
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        word = {"failure": "failed", "error": "errors"}.get(outcome, outcome)
        tally = found.setdefault(backend, {})
        tally[word] = tally.get(word, 0) + 1
    return found


@pytest.fixture(scope="module")
def projects_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, dict[str, int]]]:
    """The one command naming every project backend at once, as an operator checks what they installed: one
    pytest and one import of vLLM for the four (the cases are the same as four runs of one name each). One of the
    slow set-ups: the whole kit over four backends, a run no other test starts."""
    cwd = tmp_path_factory.mktemp("projects")
    status, output = one_command(PROJECT_BACKENDS, cwd, f"--junitxml={cwd / 'junit.xml'}")
    return status, output, outcomes_by_backend(cwd / "junit.xml", PROJECT_BACKENDS)


@pytest.mark.parametrize("name", PROJECT_BACKENDS)
def test_the_one_command_passes_for_the_projects_backends(
    name: str, projects_run: tuple[int, str, dict[str, dict[str, int]]]
) -> None:
    status, output, by_backend = projects_run
    assert status == 0, output[-4000:]
    skipped = (
        (0 if name in MLA_BACKENDS else MLA_CASES)
        + (0 if name in VARIANT_BACKENDS else VARIANT_CASES)
        + (0 if name in FP8_BACKENDS else CACHE_CASES)
        + (0 if name in GRAPH_BACKENDS else GRAPH_CASES)
    )
    expected = {"passed": ALL_DTYPES - skipped, **({"skipped": skipped} if skipped else {})}
    assert by_backend[name] == expected, output[-2000:]
    summary = counts(output)
    reported = sum(sum(found.values()) for found in by_backend.values())
    assert reported == summary.get("passed", 0) + summary.get("skipped", 0), f"JUnit {by_backend}, summary {summary}"


def test_wrong_numerics_fail_naming_the_backend_the_case_and_the_error(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(
        site,
        "wrong-attn",
        "1.0",
        {"sglang.draft_attention_backends": {"wrong": "wrong_attn:WrongAttnBackend"}},
        modules={"wrong_attn": WRONG},
    )
    status, output = one_command(["wrong"], tmp_path, "-k", "test_forward and decode-gqa-block16", path_entries=(site,))
    assert status == 1, output[-4000:]
    assert counts(output) == {"failed": 1, "skipped": 2, "deselected": ALL_DTYPES - 3}, output[-2000:]
    failed = [line for line in output.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_forward[wrong-decode-gqa-block16-float32]" in failed[0], failed
    assert (
        "vLLM forward of attnhost backend 'wrong' (vLLM WRONG), decode batch [(5, 1), (17, 1), (1, 1), (40, 1)], "
        "8 heads / 2 KV heads, block size 16, float32, LBNHC KV cache: max abs error"
    ) in failed[0], failed[0]
    assert re.search(r"max abs error \d\.\de[+-]\d\d exceeds 2e-05", failed[0]), failed[0]
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert all("backend 'wrong' does not declare" in line for line in skipped) and len(skipped) == 2, skipped


def test_wrong_mla_numerics_fail_naming_the_backend_its_mla_name_and_the_case(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_dist(
        site,
        "wrong-latent",
        "1.0",
        {"sglang.draft_attention_backends": {"wrong_latent": "wrong_latent:WrongLatentBackend"}},
        modules={"wrong_latent": WRONG_LATENT},
    )
    status, output = one_command(["wrong_latent"], tmp_path, "-k", "test_mla and -block16-", path_entries=(site,))
    assert status == 1, output[-4000:]
    # prefill takes the MHA form (torch_native's, right); the other four batches reach the absorbed form
    assert counts(output) == {"failed": 4, "passed": 1, "skipped": 10, "deselected": ALL_DTYPES - 15}, output[-2000:]
    failed = [line for line in output.splitlines() if line.startswith("FAILED")]
    decode = next(line for line in failed if "test_mla[wrong_latent-decode-block16-float32]" in line)
    assert (
        "vLLM MLA forward of attnhost backend 'wrong_latent' (vLLM WRONG_LATENT) as WRONG_LATENT_MLA, decode batch "
        "[(5, 1), (17, 1), (1, 1), (40, 1)], block size 16, float32, latent 32 + rope 16: max abs error"
    ) in decode, decode
    assert re.search(r"max abs error \d\.\de[+-]\d\d exceeds 2e-05", decode), decode


def test_fp8_cases_fail_a_forgotten_scale_and_skip_what_is_undeclared_by_name(tmp_path: Path) -> None:
    """A backend declaring float32 models, float8_e5m2 caches and pages of 32 only: the e5m2 cases in blocks of 32
    run and catch the V scale it drops; every other cache case, and the float forward cases in blocks it does not
    read, skip in a sentence naming the backend and what it does not declare."""
    site = tmp_path / "site"
    make_dist(
        site,
        "no-v-scale",
        "1.0",
        {"sglang.draft_attention_backends": {"no_v_scale": "no_v_scale:NoVScaleBackend"}},
        modules={"no_v_scale": NO_V_SCALE},
    )
    selected = "test_kv_cache_format or (test_forward and mixed-gqa)"
    status, output = one_command(["no_v_scale"], tmp_path, "-k", selected, path_entries=(site,))
    assert status == 1, output[-4000:]
    # float32 cases only: 4 batches x e5m2 in blocks of 32 fail; the other 20 cache cases and 3 forward cases skip
    ran = len(KIT_CACHE_CASES) + len(BLOCK_SIZES) * len(DTYPES)
    assert counts(output) == {"failed": 4, "skipped": ran - 4, "deselected": ALL_DTYPES - ran}, output[-2000:]
    failed = [line for line in output.splitlines() if line.startswith("FAILED")]
    assert all("test_kv_cache_format[no_v_scale-fp8_e5m2-" in line and "-block32-float32]" in line for line in failed)
    decode = next(line for line in failed if "fp8_e5m2-decode-block32" in line)
    assert (
        "vLLM forward of attnhost backend 'no_v_scale' (vLLM NO_V_SCALE), decode batch [(5, 1), (17, 1), (1, 1), "
        "(40, 1)], 8 heads / 2 KV heads, block size 32, float32, LBNHC KV cache of float8_e5m2 (--kv-cache-dtype "
        "fp8_e5m2): "
    ) in decode, decode
    skipped = "\n".join(line for line in output.splitlines() if line.startswith("SKIPPED"))
    who = "backend 'no_v_scale' does not declare"
    for reason in (
        f"{who} an FP8 KV cache of dtype float8_e4m3fn (it reads KV caches of float32, float8_e5m2; "
        "BackendCapabilities.kv_cache_dtypes): vLLM refuses --kv-cache-dtype fp8 --block-size 32 with it",
        f"{who} KV-cache page size 16 (it reads page sizes 32; BackendCapabilities.page_sizes): vLLM refuses "
        "--kv-cache-dtype fp8_e5m2 --block-size 16 with it",
        f"{who} KV-cache page size 4 (it reads page sizes 32; BackendCapabilities.page_sizes): vLLM refuses "
        "--block-size 4 with it",
        f"{who} bfloat16 (dtypes = ('float32',))",
    ):
        assert reason in skipped, skipped


def test_an_unknown_name_fails_once_with_the_registrys_message(tmp_path: Path) -> None:
    status, output = one_command(["torch_natve"], tmp_path)
    assert status == 1, output[-4000:]
    assert counts(output) == {"failed": 1, "skipped": ALL_DTYPES - 1}, output[-2000:]
    failed = [line for line in output.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_registered_by_vllms_plugin_loader[torch_natve]" in failed[0], failed
    assert "unknown attention backend 'torch_natve'; did you mean 'torch_native'?" in failed[0], failed[0]
