"""The compiled kernel never reads or writes outside the tensors it is given, whatever the caller passes.

The cases run in a child interpreter (one per group of cases, each case from a fresh state): an out-of-bounds read
or write there (a segfault, ``double free``, SIGFPE, a hang) fails the tests of its group, naming the case, instead
of killing pytest. A case passes when the call is refused with its one sentence, or (where the input is valid)
returns what a clean call returns.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest

# Each case's starting point: a pool of 64 slots and a table of 4 rows x 48 positions; two requests prefilled (slots
# 0-9 and 10-15), then an extend batch of 3 + 2 new tokens over those prefixes (slots 16-18 and 19-20: 5 query
# rows), and its q/k/v for a layer of 8 heads / 2 KV heads x 32.
STATE = """
gen = torch.Generator().manual_seed(0)
pool = KVPool(1, 64, 2, 32, max_requests=4, max_context_len=48)
layer = AttentionLayer(0, 8, 2, 32)
rows = [pool.alloc_request() for _ in range(2)]
prefill = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(rows[0], 0, 10), (rows[1], 0, 6)])
pool.set_kv(0, prefill.out_cache_loc, torch.randn(16, 2, 32, generator=gen), torch.randn(16, 2, 32, generator=gen))
batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(rows[0], 10, 3), (rows[1], 6, 2)])
q = torch.randn(5, 8, 32, generator=gen)
k, v = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
backend = CpuPagedAttnBackend()

def run(q=q):
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)

def plan(table=None, rows=(0, 1), prefix=(10, 6), extend=(3, 2), mask=None):
    return kernel.plan(pool.req_to_token if table is None else table, list(rows), prefix, extend, mask)

def attend(q, keys, values, plan, heads=8, kv_heads=2, dim=32):
    return kernel.attend(q, keys, values, plan, heads, kv_heads, dim, layer.scaling)
"""

CHILD = """
import json, sys, textwrap
import torch
from attnhost import AttentionLayer, ForwardBatch, ForwardMode, KVPool
from attnhost_cpukernels.backend import CpuPagedAttnBackend
import _attnhost_cpukernels as kernel

state, cases = json.loads(sys.stdin.read())
for name, body in cases.items():
    try:
        exec(state + textwrap.dedent(body), dict(globals()))
    except Exception as exc:
        outcome = f"REFUSED {type(exc).__name__}: {exc}"
    else:
        outcome = "RETURNED"
    print(json.dumps([name, outcome]), flush=True)
"""

RETURNED = "RETURNED"


def refused(pattern: str) -> str:
    """The outcome of a call the kernel refuses with a RuntimeError whose sentence contains ``pattern``."""
    return r"^REFUSED RuntimeError: attnhost-cpukernels: .*" + pattern


# -- q against the batch and the layer, through the backend --------------------------------------------------------

EXPECTED_Q = (
    r"q must be \[5, 8, 32\] \(or flat \[5, 256\]\) for this batch's 5 new tokens and the layer's 8 heads of 32"
)
Q_CASES = {
    "fewer-heads": ("run(q[:, :4])", refused(EXPECTED_Q + r", got \[5, 4, 32\]$")),
    "smaller-head-dim": ("run(q[..., :16])", refused(EXPECTED_Q + r", got \[5, 8, 16\]$")),
    "fewer-tokens": ("run(q[:3])", refused(EXPECTED_Q + r", got \[3, 8, 32\]$")),
    "more-tokens": ("run(torch.cat([q, q]))", refused(EXPECTED_Q + r", got \[10, 8, 32\]$")),
    "flat-too-narrow": ("run(q.flatten(1)[:, :128])", refused(EXPECTED_Q + r", got \[5, 128\]$")),
    "one-token-as-flat": ("run(q[0])", refused(EXPECTED_Q + r", got \[8, 32\]$")),
    "flat-right-width": ("assert torch.equal(run(q.flatten(1)).view(5, 8, 32), run())", RETURNED),
}

# -- req_to_token entries, through the backend ---------------------------------------------------------------------

PAST_THE_CACHE = """
pool.req_to_token[rows[0], 4] = {value}
before = pool.k_buffer(0).clone(), pool.v_buffer(0).clone()
try:
    run()
finally:  # refused before the fused cache write
    assert torch.equal(pool.k_buffer(0), before[0]) and torch.equal(pool.v_buffer(0), before[1])
"""
NOT_A_SLOT = (
    r"req_to_token\[0, 4\] = {value} \(request 0 of the batch\) is not a slot of this layer's K/V buffers "
    r"\(64 slots\); the table must name a slot of the KV cache for every token the batch reads$"
)
NEGATIVE = "pool.req_to_token[rows[0], 4] = {value}\nbackend.init_forward_metadata(batch)"
NEGATIVE_REFUSAL = (
    r"req_to_token\[0, 4\] = {value} \(request 0 of the batch, which reads its first 13 entries\) is not a slot"
)
INT32 = """
pool.req_to_token = pool.req_to_token.to(torch.int32).t().contiguous().t()  # int32, column-major
assert pool.req_to_token.stride() == (1, 4)
pool.req_to_token[rows[1], 7] = {value}
run()
"""
# New K/V of another dtype than the cache (a conversion, FP8 quantising) are written only after every check too.
CONVERTED = """
{setup}
{mistake}
before = [buffer.view(torch.uint8).clone() for buffer in (pool.k_buffer(0), pool.v_buffer(0))]
try:
    backend.init_forward_metadata(batch)
    backend.forward({query}, k.to(torch.bfloat16), v.to(torch.bfloat16), layer, batch)
finally:  # refused before the converted K/V were written
    after = [buffer.view(torch.uint8) for buffer in (pool.k_buffer(0), pool.v_buffer(0))]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
"""
FP8_POOL = """
pool = KVPool(1, 64, 2, 32, max_requests=4, max_context_len=48, dtype=torch.float8_e4m3fn)
rows = [pool.alloc_request() for _ in range(2)]
ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(rows[0], 0, 10), (rows[1], 0, 6)])
batch = ForwardBatch.prepare(pool, ForwardMode.EXTEND, [(rows[0], 10, 3), (rows[1], 6, 2)])
"""
PAST = "pool.req_to_token[rows[0], 4] = 64"
TABLE_CASES = {
    **{
        f"{cache}-{kind}": (
            CONVERTED.format(setup=setup, mistake=mistake, query=query),
            refused(NOT_A_SLOT.format(value=64) if mistake else EXPECTED_Q + r", got \[5, 4, 32\]$"),
        )
        for cache, setup in (("converted-kv", ""), ("fp8-cache", FP8_POOL))
        for kind, mistake, query in (("past-the-cache", PAST, "q"), ("bad-q", "", "q[:, :4]"))
    },
    **{
        f"past-the-cache-{name}": (PAST_THE_CACHE.format(value=value), refused(NOT_A_SLOT.format(value=value)))
        for name, value in (("2^31-1", 2**31 - 1), ("10^12", 10**12), ("num_slots", 64), ("2^63-1", 2**63 - 1))
    },
    **{
        f"negative-{name}": (NEGATIVE.format(value=value), refused(NEGATIVE_REFUSAL.format(value=value)))
        for name, value in (("-1", -1), ("-2^31", -(2**31)))
    },
    "int32-strided--1": (INT32.format(value=-1), refused(r"req_to_token\[1, 7\] = -1 \(request 1 of the batch, ")),
    "int32-strided-2^31-1": (
        INT32.format(value=2**31 - 1),
        refused(r"req_to_token\[1, 7\] = 2147483647 \(request 1 of the batch\) is not a slot of this layer's"),
    ),
    # past a request's prefix + extend, and in rows outside the batch, a server's table holds stale values
    "entries-not-read": (
        """
        clean = run()
        pool.req_to_token[rows[0], 13:] = 10**12
        pool.req_to_token[rows[1], 8] = -1
        pool.req_to_token[2:] = -5
        assert torch.equal(run(), clean)
        """,
        RETURNED,
    ),
    # the plan owns what it checked: a write into the table after planning steers no read of its layers
    "written-after-planning": (
        """
        clean = run()
        backend.init_forward_metadata(batch)
        pool.req_to_token[rows[0], :13] = 10**12
        assert torch.equal(backend.forward(q, k, v, layer, batch), clean)
        """,
        RETURNED,
    ),
}

# -- direct calls of the extension: the plan, the layer, a plan against other tensors -------------------------------

# a table as wide as int64 allows, owning one integer (an expanded view): lengths whose squares overflow
WIDE = "plan(table=torch.zeros(1, 1, dtype=torch.int64).expand(1, 2**62), rows=(0, 0), extend=(1, 2**32))"
DIRECT_CASES = {
    "0-kv-heads": (
        "attend(q, torch.zeros(64, 0, 32), torch.zeros(64, 0, 32), plan(), kv_heads=0)",
        refused(r"num_heads=8, num_kv_heads=0, head_dim=32 are not a layer: all must be positive"),
    ),
    "heads-not-a-multiple": (
        "attend(torch.randn(5, 6, 32), torch.zeros(64, 4, 32), torch.zeros(64, 4, 32), plan(), 6, 4)",
        refused(r"num_heads=6, num_kv_heads=4, head_dim=32 are not a layer: .* a multiple of num_kv_heads$"),
    ),
    "row-past": (
        "plan(rows=(0, 4))",
        refused(r"request 1 of the batch names req_to_token row 4, outside the table's 4 "),
    ),
    "row-negative": ("plan(rows=(-1, 1))", refused(r"request 0 of the batch names req_to_token row -1, outside")),
    "prefix-negative": ("plan(prefix=(-3, 6))", refused(r"request 0 .* has prefix_len -3 and extend_len 3; they must")),
    "extend-0": (
        "plan(extend=(3, 0))",
        refused(r"request 1 of the batch has prefix_len 6 and extend_len 0; they must"),
    ),
    "past-the-width": (
        "plan(prefix=(10, 47))",
        refused(r"request 1 of the batch reads 47 \+ 2 positions of req_to_token row 1, which has 48 columns$"),
    ),
    "huge-prefix": ("plan(prefix=(2**62, 6))", refused(r"request 0 of the batch reads 4611686018427387904 \+ 3 ")),
    "overflow": (WIDE, refused(r"the batch's lengths overflow int64 at request 1$")),
    "lengths": ("plan(extend=(3,))", refused(r"the batch has 2 table rows but 2 prefix lengths and 1 extend lengths")),
    "mask-size": (
        "plan(mask=torch.ones(12, dtype=torch.bool))",
        refused(r"tree mask must be a 1-D bool tensor of 13 "),
    ),
    "mask-dtype": (
        "plan(mask=torch.ones(13, dtype=torch.int64))",
        refused(r"tree mask must be a 1-D bool tensor of 13"),
    ),
    "table-dtype": (
        "plan(table=pool.req_to_token.float())",
        refused(r"req_to_token must be a 2-D int32 or int64 tensor"),
    ),
    "table-1-d": ("plan(table=pool.req_to_token[0])", refused(r"req_to_token must be a 2-D int32 or int64 tensor")),
    # a stale plan: its token count against q, its largest slot (20, at row 1, position 7) against smaller buffers
    "stale-plan-q": ("attend(q[:2], pool.k_buffer(0), pool.v_buffer(0), plan())", refused(r"q must be \[5, 8, 32\]")),
    "stale-plan-slots": (
        "attend(q, pool.k_buffer(0)[:20], pool.v_buffer(0)[:20], plan())",
        refused(
            r"req_to_token\[1, 7\] = 20 \(request 1 of the batch\) is not a slot of this layer's K/V buffers \(20 "
        ),
    ),
    "no-plan-but-plan": ("kernel.Plan()", r"^REFUSED TypeError: .*No constructor defined"),
    "none-as-plan": ("attend(q, pool.k_buffer(0), pool.v_buffer(0), None)", r"^REFUSED TypeError: .*incompatible"),
    "valid-plan": (
        """
        out = attend(q, pool.k_buffer(0), pool.v_buffer(0), plan())
        backend.init_forward_metadata(batch)
        assert torch.equal(out, backend.forward(q, k, v, layer, batch, save_kv_cache=False))
        assert repr(plan()) == "<_attnhost_cpukernels.Plan: 2 requests, 5 new tokens, slots up to 20>", repr(plan())
        """,
        RETURNED,
    ),
}

GROUPS = {"q": Q_CASES, "table": TABLE_CASES, "direct": DIRECT_CASES}


def _run_child(cases: dict[str, str]) -> dict[str, str]:
    """Each case's body, after a fresh STATE, in one child interpreter: ``REFUSED <type>: <message>`` or
    ``RETURNED``. A crash or a hang of the child fails the caller, naming the case it was running."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # the threaded path, as a server runs it
    stdin = json.dumps([STATE, cases])
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD], input=stdin, capture_output=True, text=True, timeout=120, env=env
        )
        stdout, stderr, failure = proc.stdout, proc.stderr, "" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, failure = str(exc.stdout or ""), str(exc.stderr or ""), "a hang (no answer in 120 s)"
    done: dict[str, str] = dict(json.loads(line) for line in stdout.splitlines() if line.startswith("["))
    if failure:
        running = next((name for name in cases if name not in done), "?")
        pytest.fail(f"the kernel crashed ({failure}) in case {running!r}: {stderr[-2000:]}")
    return done


@functools.cache
def _group(name: str) -> dict[str, str]:
    return _run_child({case: body for case, (body, _) in GROUPS[name].items()})


@pytest.mark.parametrize(("group", "case"), [(g, c) for g, cases in GROUPS.items() for c in cases])
def test_the_kernel_refuses_what_would_take_it_outside_its_buffers(group: str, case: str) -> None:
    expected = GROUPS[group][case][1]
    outcome = _group(group)[case]
    assert re.search(expected, outcome, re.DOTALL), f"{case}: {outcome}"
