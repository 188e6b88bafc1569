"""A backend's ``capabilities`` as a clumsy plugin writes them: kept as declared, or refused naming the plugin.

Each plugin is a real installed distribution (``distgen``); the runner is attnhost's own ``ModelRunner`` in a fresh
interpreter. A generator for a tuple field is read once and kept (not consumed into ``()``, which for ``head_dims``
means "any"); a ``capabilities`` that is not a ``BackendCapabilities``, or whose reading raises, is refused when the
runner builds the backend, in one sentence naming the backend, its distribution and the way out, never replaced by
the defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import GROUP, run_python

from attnhost.backend import BackendCapabilities

PLUGIN = """
from attnhost import AttentionBackend, BackendCapabilities


class Base(AttentionBackend):
    def init_forward_metadata(self, forward_batch):
        pass

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        raise NotImplementedError


class AsDict(Base):
    capabilities = {"dtypes": ("float32",), "head_dims": (64,)}


class _RaisingMeta(type(AttentionBackend)):
    @property
    def capabilities(cls):  # reading the class's capabilities raises
        raise RuntimeError("no capabilities today")


class Raising(Base, metaclass=_RaisingMeta):
    pass

"""

RUN = """
import json
from attnhost import ModelRunner, ServerArgs
try:
    runner = ModelRunner(ServerArgs(attention_backend=NAME), num_layers=1, num_kv_heads=2, head_dim=64)
except Exception as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
else:
    print(json.dumps(["built", None]))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("capabilities-site")
    backends = {"as_dict": "caps_plugin:AsDict", "raising": "caps_plugin:Raising"}
    make_dist(site, "caps-attn", "1.0", {GROUP: backends}, modules={"caps_plugin": PLUGIN})
    return site


def _build(site: Path, name: str) -> list[str | None]:
    code = RUN.replace("NAME", repr(name))
    result = run_python(code, path_entries=[site], env={"ATTNHOST_PLATFORM": "cpu"})
    assert result.returncode == 0, result.stderr
    outcome: list[str | None] = json.loads(result.stdout.strip().splitlines()[-1])
    return outcome


def test_generators_are_read_once_and_kept() -> None:
    caps = BackendCapabilities(
        head_dims=(d for d in (64, 128)), dtypes=(d for d in ("float32",)), page_sizes=(p for p in (16,))
    )
    assert (caps.head_dims, caps.dtypes, caps.page_sizes) == ((64, 128), ("float32",), (16,))
    assert caps.kv_cache_dtypes is None
    # (64, 128), not "any": an engine refuses a head dim of 256
    assert caps.refusal(dtype="float32", head_dim=256) == "head dim 256 (it supports 64, 128)"


@pytest.mark.torch
@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("as_dict", "is a dict"),
        ("raising", "raised RuntimeError: no capabilities today when read"),
    ],
)
def test_unusable_capabilities_are_refused_naming_the_plugin(site: Path, name: str, what: str) -> None:
    kind, message = _build(site, name)
    assert kind == "BackendUnavailableError", (kind, message)
    assert message is not None
    assert f"attention backend {name!r}" in message and "caps-attn" in message, message
    assert what in message, message
    assert "declare capabilities = BackendCapabilities(...)" in message, message
