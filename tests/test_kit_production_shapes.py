"""The conformance kit fails a backend that is wrong only where production runs.

Each backend below is ``torch_native`` made wrong (0.25 added to its output) under one condition that only
production sizes meet, or making one real mistake that only shows there (a long window or a large soft-cap ignored).
They ship as one real installed plugin and run through ``pytest --attnhost-backend`` in a fresh interpreter, as an
author would run the kit; every one of them must fail its production-shape cases, and the same backend without a
condition must pass them (so the failures come from the conditions, not from the harness).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.torch
from distgen import make_dist  # noqa: E402
from helpers import GROUP, kit_outcomes  # noqa: E402

from attnhost.testing.cases import PRODUCTION_SHAPES  # noqa: E402

#: backend name: the condition under which it is wrong (what the kit must reach).
CONDITIONS = {
    "long_100": "a request longer than 100 tokens",
    "long_512": "a request longer than 512 tokens",
    "prefix_90": "a cached prefix longer than 90 tokens",
    "heads_8": "query heads from the 8th on",
    "heads_16": "query heads from the 16th on",
    "head_dim": "a head dim other than 32",
    "batch_8": "8 or more requests in a batch",
    "row_8": "request rows from 8 on",
    "slot_32768": "a request holding a slot of 32768 or more",
    "int32_table": "an int32 request table",
    "strided_cache": "strided K/V cache buffers",
    "strided_q": "a non-contiguous query",
    "strided_kv": "non-contiguous new K/V",
    "window_50": "a window of 50 or more",
    "cap_10": "a soft-cap of 10 or more",
    "tree_5": "a speculative tree deeper than 5",
    "layer_2": "layer ids from 2 on",
    "decode_6": "a decode batch of more than 6 requests",
    "ignores_long_windows": "windows of 50 or more ignored",
    "ignores_large_caps": "soft-caps of 10 or more ignored",
}

_PLUGIN = f'''\
"""Hooks only: torch_native, right, and wrong under one production-sized condition each."""
from attnhost import BackendSpec, hookimpl

NAMES = {["right", *CONDITIONS]!r}


@hookimpl
def attnhost_attention_backends():
    return [
        BackendSpec(name=n, factory=f"attnhost_shapes.impl:{{n}}", requires=("torch",), description=f"wrong: {{n}}")
        for n in NAMES
    ]
'''

_IMPL = '''\
"""torch_native, with 0.25 added to the output where ``wrong`` says so, or a variant dropped where it is large."""
import dataclasses

import torch

from attnhost.testing.reference import tree_blocks
from attnhost_builtin.torch_native import TorchNativeAttnBackend


def per_request(fb, flags):
    """A [tokens, 1, 1] mask: each request's flag for each of its new tokens."""
    counts = torch.tensor(fb.extend_seq_lens_cpu)
    return torch.tensor(flags).repeat_interleave(counts).view(-1, 1, 1)


def max_slot(fb, i):
    row = int(fb.req_pool_indices[i])
    return int(fb.kv_pool.req_to_token[row, : fb.seq_lens_cpu[i]].max())


def depth(fb):
    blocks = tree_blocks(fb)
    return max((int(b.sum(1).max()) - 1 for b in blocks), default=0) if blocks else 0


WRONG = {
    "right": lambda q, k, layer, fb: False,
    "long_100": lambda q, k, layer, fb: per_request(fb, [n > 100 for n in fb.seq_lens_cpu]),
    "long_512": lambda q, k, layer, fb: per_request(fb, [n > 512 for n in fb.seq_lens_cpu]),
    "prefix_90": lambda q, k, layer, fb: per_request(fb, [n > 90 for n in fb.prefix_lens_cpu]),
    "heads_8": lambda q, k, layer, fb: (torch.arange(layer.num_heads) >= 8).view(1, -1, 1),
    "heads_16": lambda q, k, layer, fb: (torch.arange(layer.num_heads) >= 16).view(1, -1, 1),
    "head_dim": lambda q, k, layer, fb: layer.head_dim != 32,
    "batch_8": lambda q, k, layer, fb: fb.batch_size >= 8,
    "row_8": lambda q, k, layer, fb: per_request(fb, [int(r) >= 8 for r in fb.req_pool_indices]),
    "slot_32768": lambda q, k, layer, fb: per_request(fb, [max_slot(fb, i) >= 32768 for i in range(fb.batch_size)]),
    "int32_table": lambda q, k, layer, fb: fb.kv_pool.req_to_token.dtype == torch.int32,
    "strided_cache": lambda q, k, layer, fb: not fb.kv_pool.k_buffer(layer.layer_id).is_contiguous(),
    "strided_q": lambda q, k, layer, fb: not q.is_contiguous(),
    "strided_kv": lambda q, k, layer, fb: k is not None and not k.is_contiguous(),
    "window_50": lambda q, k, layer, fb: layer.sliding_window_size >= 50,
    "cap_10": lambda q, k, layer, fb: layer.logit_cap >= 10,
    "tree_5": lambda q, k, layer, fb: depth(fb) > 5,
    "layer_2": lambda q, k, layer, fb: layer.layer_id >= 2,
    "decode_6": lambda q, k, layer, fb: fb.forward_mode.is_decode() and fb.batch_size > 6,
}
DROPPED = {
    "ignores_long_windows": lambda layer: {"sliding_window_size": -1} if layer.sliding_window_size >= 50 else {},
    "ignores_large_caps": lambda layer: {"logit_cap": 0.0} if layer.logit_cap >= 10 else {},
}


def _backend(name):
    wrong = WRONG.get(name, WRONG["right"])
    dropped = DROPPED.get(name, lambda layer: {})

    class Wrong(TorchNativeAttnBackend):
        def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
            seen = dataclasses.replace(layer, **dropped(layer))
            out = super().forward_extend(q, k, v, seen, fb, save_kv_cache, **kwargs)
            return out + 0.25 * torch.as_tensor(wrong(q, k, layer, fb)).to(out.dtype)

        def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
            seen = dataclasses.replace(layer, **dropped(layer))
            out = super().forward_decode(q, k, v, seen, fb, save_kv_cache, **kwargs)
            return out + 0.25 * torch.as_tensor(wrong(q, k, layer, fb)).to(out.dtype)

    Wrong.__name__ = Wrong.__qualname__ = name
    return Wrong


globals().update({name: _backend(name) for name in ["right", *WRONG, *DROPPED]})
'''


@pytest.fixture(scope="module")
def production_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One run of the kit's production-shape cases against every backend: ``{node id: failure text}`` ("" if
    passed)."""
    site = tmp_path_factory.mktemp("shapes-site")
    make_dist(
        site,
        "attnhost-shapes",
        "0.1",
        {GROUP: {"shapes": "attnhost_shapes"}},
        modules={"attnhost_shapes": _PLUGIN, "attnhost_shapes.impl": _IMPL},
    )
    cwd = tmp_path_factory.mktemp("author")
    runs = kit_outcomes(site, cwd, ["right", *CONDITIONS], "test_production_shapes")
    outcome = {key.removeprefix("test_production_shapes[")[:-1]: text for key, text in runs.items()}
    assert len(outcome) == len(PRODUCTION_SHAPES) * (1 + len(CONDITIONS)), sorted(runs)
    return outcome


def test_the_right_backend_passes_every_production_shape(production_run: dict[str, str]) -> None:
    for shape in PRODUCTION_SHAPES:
        assert production_run[f"right-{shape}"] == "", production_run[f"right-{shape}"]


@pytest.mark.parametrize("backend", sorted(CONDITIONS))
def test_a_backend_wrong_only_at_production_sizes_fails_the_kit(production_run: dict[str, str], backend: str) -> None:
    failures = [production_run[f"{backend}-{shape}"] for shape in PRODUCTION_SHAPES]
    assert any(failures), f"backend wrong for {CONDITIONS[backend]} passed every production shape"
    for message in filter(None, failures):  # each failure names the shape, the batch and where it went wrong
        assert re.match(r"(Failed: )?production shape [\w-]+ \(.*\): \w", message), message
        assert "max abs error" in message, message
