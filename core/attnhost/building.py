"""Building a backend from its factory, once per model runner: the host's side of the contract, not part of what a
plugin author implements (which is why it is not in :mod:`attnhost.backend`). Every refusal names the runner, the
backend and its plugin; a factory that hands one instance to two runners is refused, as the target would then run the
draft's backend."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from attnhost.backend import AttentionBackend, AttentionRunner
from attnhost.errors import BackendUnavailableError, describe_exception, safe_repr

__all__ = ["build_backend"]

# The live backends factories have handed to runners, by id (a virtual subclass without weak references: forever).
_handed_out: weakref.WeakValueDictionary[int, AttentionBackend] = weakref.WeakValueDictionary()
_unweakrefable: dict[int, AttentionBackend] = {}
_handed_out_lock = threading.Lock()


def build_backend(
    factory: Callable[[AttentionRunner], object], runner: AttentionRunner, *, where: str, way_out: str, owner: str
) -> AttentionBackend:
    """``factory(runner)``, each refusal a ``BackendUnavailableError`` (``where`` names runner, backend and plugin). One
    instance handed to two runners (a cached singleton) would make the target run the draft's backend
    (docs/architecture.md), so the second hand-out is refused. Whatever the factory raises, ``SystemExit`` included,
    is wrapped."""
    try:
        backend = factory(runner)
    except (Exception, SystemExit) as exc:
        raise BackendUnavailableError(f"{where}: its factory raised {describe_exception(exc)}; {way_out}") from exc
    if not isinstance(backend, AttentionBackend):
        raise BackendUnavailableError(
            f"{where}: its factory returned {type(backend).__name__} {safe_repr(backend)}, not an "
            f"attnhost.AttentionBackend; report this to the maintainers of {owner}"
        )
    if type(backend).forward is not AttentionBackend.forward:
        raise BackendUnavailableError(
            f"{where}: its class {type(backend).__qualname__} overrides AttentionBackend.forward, the contract's "
            "router, which SGLang bypasses (it calls forward_extend and forward_decode by name), so the override "
            "would run in vLLM and not in SGLang; implement forward_extend, forward_decode (and the MLA methods) "
            f"instead — report this to the maintainers of {owner}"
        )
    key = id(backend)
    with _handed_out_lock:
        if _handed_out.get(key) is backend or _unweakrefable.get(key) is backend:
            raise BackendUnavailableError(
                f"{where}: its factory returned an instance ({safe_repr(backend)}) it had already returned for "
                "another runner; every runner needs its own, or the target runs the draft's backend "
                f"— report this to the maintainers of {owner}"
            )
        try:
            _handed_out[key] = backend
        except TypeError:  # no weak reference possible
            _unweakrefable[key] = backend
    return backend
