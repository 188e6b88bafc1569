"""SGLang's own dense-attention test kit, driven for one backend name (used by tests/sglang and the engine suite).

The kit (``sglang.test.kits.attention_unittest``) builds a backend by name
through SGLang's ``ATTENTION_BACKENDS`` on real ``ReqToTokenPool`` /
``MHATokenToKVPool`` / ``RadixAttention`` objects with shuffled pages and
compares it with its own reference. It expects a ``unittest.TestCase``; a
skip there would hide a missing backend, so :class:`KitCase` turns it into a
failure. Importing this module imports SGLang (install the shim first).
"""

from __future__ import annotations

import contextlib
import re
import unittest
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
    build_dense_attention_fixture,
    make_dense_cases,
    run_dense_attention_case,
)

__all__ = ["DTYPES", "KitCase", "build_fixture", "dense_cases", "failure_named", "run_case"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KitCase(unittest.TestCase):
    """The ``testcase`` the kit expects; a skip would hide a missing backend, so it fails instead."""

    def runTest(self) -> None:  # pragma: no cover - never run as a test itself
        pass

    def skipTest(self, reason: object) -> NoReturn:
        raise AssertionError(f"the kit skipped the case: {reason}")


def dense_cases(backend: str) -> list[Any]:
    """SGLang's dense cases for *backend* (the same list for every name)."""
    return list(make_dense_cases(backend))


_GREATEST = re.compile(r"Greatest absolute difference: (\S+) at index (\([^)]*\)) \(up to (\S+) allowed\)")
_MISMATCHED = re.compile(r"Mismatched elements: ([^\n]+)")


@contextlib.contextmanager
def failure_named(lead: str) -> Iterator[None]:
    """Run one of SGLang's kit cases; a numeric failure becomes one line: ``lead``, the error size, how many
    elements.

    torch's ``assert_close`` message starts with "Tensor-likes are not close!",
    which names neither the backend nor the case, and runs to several lines
    per case; a backend that fails every case would print screens of them.
    """
    try:
        yield
    except AssertionError as error:
        found = _GREATEST.search(str(error))
        if found is None:
            raise
        size, where, allowed = found.groups()
        mismatched = _MISMATCHED.search(str(error))
        count = f" ({mismatched.group(1)} elements off)" if mismatched else ""
        raise AssertionError(
            f"{lead}: max abs error {size} at {where} exceeds SGLang's tolerance ({allowed}){count}"
        ) from None


def run_case(case: Any, dtype: torch.dtype) -> None:
    """One case of SGLang's kit, as the kit runs it; a numeric failure leads with the backend, case and error size."""
    dtype_name = str(dtype).removeprefix("torch.")
    lead = f"backend {case.backend!r}, SGLang dense case {case.name!r} ({dtype_name})"
    with torch.no_grad(), failure_named(lead):
        run_dense_attention_case(KitCase(), case, device="cpu", dtype=dtype)


def build_fixture(case: Any, dtype: torch.dtype = torch.float32) -> Any:
    with torch.no_grad():
        return build_dense_attention_fixture(KitCase(), case, device="cpu", dtype=dtype)
