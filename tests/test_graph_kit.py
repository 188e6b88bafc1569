"""The conformance kit's graph cases (``attnhost.testing.graph_conformance``): a correct graph-capable backend
passes them, and each way of breaking the promise of ``cuda_graph`` fails them naming the mistake.

The backends are one installed distribution (written by ``distgen``), and the kit runs against them as a plugin
author runs it: ``pytest`` in a fresh interpreter on a file that only subclasses ``BackendConformance``, the
outcome read from JUnit XML.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from distgen import make_dist
from helpers import GROUP, subprocess_env

pytest.importorskip("torch")  # the conformance kit runs backends; the py312/py313 envs have no torch
pytestmark = pytest.mark.torch
from test_conformance import Outcome, parse_junit  # noqa: E402

_PLUGIN = '''\
"""Hooks only."""
from attnhost import BackendSpec, hookimpl

_BACKENDS = {
    "graphed": "Graphed",
    "graph_reads_host": "ReadsHost",
    "graph_allocates": "Allocates",
    "graph_pads_live": "PadsLive",
    "graph_breaks": "Breaks",
}


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(name=n, factory=f"attnhost_graphs.impl:{c}", requires=("torch",), description=f"test backend {n}")
        for n, c in _BACKENDS.items()
    ]
'''

_IMPL = '''\
"""Masked dense attention over every request's keys up to the host bound: no host read, re-planned in place."""
import torch

from attnhost import AttentionBackend, BackendCapabilities


class Graphed(AttentionBackend):
    """A correct graph-capable backend."""

    capabilities = BackendCapabilities(cuda_graph=True)
    read_host = False  # the bug: read the lengths on the host in the step
    allocate = False  # the bug: plan into new tensors at every step
    padding_slot = None  # the bug: padded rows' K/V written to this slot instead of slot 0
    graph_break = False  # the bug: leave the graph in the forward

    def __init__(self, runner=None):
        super().__init__(runner)
        self._batch, self._plan = None, None

    def init_forward_metadata(self, fb):
        if self.read_host:
            fb.seq_lens.tolist()
        device = fb.seq_lens.device
        lens = fb.extend_seq_lens_cpu
        width = max(fb.seq_lens_cpu)
        request = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)]).to(device, non_blocking=True)
        step = torch.tensor([j for n in lens for j in range(n)]).to(device, non_blocking=True)
        position = fb.prefix_lens.index_select(0, request) + step
        slots = fb.kv_pool.req_to_token.index_select(0, fb.req_pool_indices)[:, :width].index_select(0, request)
        visible = torch.arange(width, device=device).unsqueeze(0) <= position.unsqueeze(1)
        if self._batch is fb and not self.allocate:
            self._plan[0].copy_(slots)
            self._plan[1].copy_(visible)
        else:
            self._batch, self._plan = fb, (slots, visible)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        slots, visible = self._plan
        pool = fb.kv_pool
        if save_kv_cache:
            loc = fb.out_cache_loc
            if self.padding_slot is not None:
                loc = torch.where(loc == 0, self.padding_slot, loc)
            pool.set_kv(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)
        if self.graph_break:
            torch._dynamo.graph_break()
        group = layer.num_heads // layer.num_kv_heads
        keys = pool.k_buffer(layer.layer_id)[slots].double().repeat_interleave(group, dim=2)
        values = pool.v_buffer(layer.layer_id)[slots].double().repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,twhd->thw", q.double(), keys) * layer.scaling
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        return torch.einsum("thw,twhd->thd", scores.softmax(-1), values).to(q.dtype)


class ReadsHost(Graphed):
    """Reads the lengths on the host."""

    read_host = True


class Allocates(Graphed):
    """Plans into new tensors every step."""

    allocate = True


class PadsLive(Graphed):
    """Writes the padded rows' K/V into slot 1, a live request's key."""

    padding_slot = 1


class Breaks(Graphed):
    """Breaks the graph in the forward."""

    graph_break = True
'''

_KIT_FILE = """\
from attnhost.testing import BackendConformance


class TestGraphed(BackendConformance):
    backend_name = "graphed"


class TestReadsHost(BackendConformance):
    backend_name = "graph_reads_host"


class TestAllocates(BackendConformance):
    backend_name = "graph_allocates"


class TestPadsLive(BackendConformance):
    backend_name = "graph_pads_live"


class TestBreaks(BackendConformance):
    backend_name = "graph_breaks"
"""

GRAPH_TESTS = ("test_graph_replays_read_nothing_on_the_host", "test_graph_step_compiles_whole_and_keeps_its_storage")


@pytest.fixture(scope="module")
def graph_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Outcome]:
    """One pytest run of the kit's graph cases against every backend of the distribution."""
    site = tmp_path_factory.mktemp("graph-site")
    make_dist(
        site,
        "attnhost-graphs",
        "0.1",
        {GROUP: {"graphs": "attnhost_graphs"}},
        modules={"attnhost_graphs": _PLUGIN, "attnhost_graphs.impl": _IMPL},
    )
    project = tmp_path_factory.mktemp("graph-author")
    (project / "test_kit.py").write_text(_KIT_FILE)
    junit = project / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", "-k", "test_graph_"],
        capture_output=True,
        text=True,
        cwd=project,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(project / "xdg-cache")}),
        timeout=600,
    )
    assert junit.exists(), proc.stdout + proc.stderr
    return parse_junit(junit)


def _outcome(results: dict[tuple[str, str], Outcome], cls: str, test: str) -> Outcome:
    return results[(cls, test)]


def test_a_correct_graph_capable_backend_passes(graph_results: dict[tuple[str, str], Outcome]) -> None:
    for test in GRAPH_TESTS:
        outcome = _outcome(graph_results, "TestGraphed", test)
        assert outcome.status == "passed", outcome.message


def test_a_backend_that_reads_on_the_host_fails_naming_the_read(
    graph_results: dict[tuple[str, str], Outcome],
) -> None:
    outcome = _outcome(graph_results, "TestReadsHost", GRAPH_TESTS[0])
    assert outcome.status == "failed"
    assert outcome.message.startswith(
        "graph capture (every row padding): Tensor.tolist() read a device tensor on the host inside a step"
    ), outcome.message


def test_a_backend_that_plans_into_new_tensors_fails_naming_what_moved(
    graph_results: dict[tuple[str, str], Outcome],
) -> None:
    assert _outcome(graph_results, "TestAllocates", GRAPH_TESTS[0]).status == "passed"  # right, and read-free
    outcome = _outcome(graph_results, "TestAllocates", GRAPH_TESTS[1])
    assert outcome.status == "failed"
    assert "compiled graph replay 1 (3 of 4 rows live): the step read " in outcome.message, outcome.message
    assert "_plan" in outcome.message and "at another address than at capture" in outcome.message, outcome.message


def test_a_backend_that_writes_a_padded_row_into_a_live_slot_fails(
    graph_results: dict[tuple[str, str], Outcome],
) -> None:
    for test in GRAPH_TESTS:
        outcome = _outcome(graph_results, "TestPadsLive", test)
        assert outcome.status == "failed"
        assert (
            "slot 1 changed, but no live row writes it; a padded row (request row 0, length 1, write slot 0) "
            "may write slot 0 only" in outcome.message
        ), outcome.message


def test_a_backend_whose_forward_breaks_the_graph_fails(graph_results: dict[tuple[str, str], Outcome]) -> None:
    assert _outcome(graph_results, "TestBreaks", GRAPH_TESTS[0]).status == "passed"
    outcome = _outcome(graph_results, "TestBreaks", GRAPH_TESTS[1])
    assert outcome.status == "failed"
    assert "must trace as one graph (no graph break)" in outcome.message, outcome.message
