"""Registers attnhost's backends in vLLM's ``AttentionBackendEnum``, one member and one class per name.

vLLM's own mechanism, no patch to its source: ``register_backend(NAME,
class_path)`` adds an enum member, and ``--attention-backend name`` (or
``"attention_backend": "name"`` in ``--speculative-config``) resolves to it as
``AttentionBackendEnum[name.upper()]``. Which backends and under which names
follows the rule every engine bridge shares
(:func:`attnhost.engines.export.plan_exports`): implemented and available
ones only; a name vLLM already has keeps vLLM's backend and the attnhost one
becomes ``ATTNHOST_<NAME>``, with one warning, unless the operator opts in
with ``ATTNHOST_VLLM_OVERRIDE``. A backend that declares
``BackendCapabilities.mla`` gets a second name for MLA models,
``<NAME>_MLA``, whose class is vLLM's MLA interface
(:mod:`attnhost.engines.vllm.mla_names`, :mod:`attnhost.engines.vllm.mla_adapter`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from attnhost.engines.export import ExportedBackend, ExportPlan, plan_exports
from attnhost.engines.identity import LogOnce, declares_mla
from attnhost.engines.vllm.mla_names import plan_mla_exports
from attnhost.engines.vllm.names import BACKENDS_MODULE, vllm_name
from attnhost.errors import BackendUnavailableError
from attnhost.host import engine_load_failure
from attnhost.settings import VLLM_OVERRIDE_ENV as OVERRIDE_ENV

__all__ = [
    "ClassPath",
    "backend_class",
    "class_path",
    "current_plan",
    "exported",
    "install",
    "mla_name",
    "registered_value",
    "restore",
]

logger = logging.getLogger("attnhost.engines.vllm")


# -- the enum values that survive a spawned process ---------------------------------------
#
# vLLM keeps a chosen backend as an ``AttentionBackendEnum`` member inside its config, and an enum member pickles
# *by value*: ``(AttentionBackendEnum, (value,))``. A spawned child (vLLM spawns once CUDA is initialised, under
# Ray, with ``--numa-bind``) unpickles its config before it loads any plugin, so a member registered at run time
# is unknown there and unpickling fails with ``ValueError: '<value>' is not a valid AttentionBackendEnum``. The
# member's value is therefore a ClassPath: a ``str`` (vLLM uses it as the backend's class path) that pickles as a
# call to :func:`restore`, which registers attnhost's backends in the child before the enum lookup and hands back
# the registered value. No vLLM code is patched and nothing depends on which plugin group loads first. Each vLLM
# name gets its own class path: two members with one value would alias each other across the pickle.


class ClassPath(str):
    """The value of an attnhost member of ``AttentionBackendEnum``: a class path that re-registers on unpickling."""

    __slots__ = ()

    @property
    def engine_name(self) -> str:
        return self.rsplit(".", 1)[1]

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return restore, (str(self),)


def class_path(engine_name: str) -> ClassPath:
    return ClassPath(f"{BACKENDS_MODULE}.{engine_name}")


def restore(path: str) -> str:
    """Unpickling hook: register attnhost's backends in this process, return the registered enum value."""
    return registered_value(ClassPath(path).engine_name)


_lock = threading.RLock()
_plan: ExportPlan | None = None
_ours: dict[str, ExportedBackend] = {}
"""vLLM names this process registered (or, with the override, took over), with what they serve."""
_mla_names: dict[str, str] = {}
"""Dense vLLM name → the MLA name of the same backend, for the backends that declare ``mla``."""
_classes: dict[str, type[Any]] = {}
_log_once = LogOnce(logger)


def current_plan() -> ExportPlan | None:
    """What the last :func:`install` registered in this process (``None`` before it ran)."""
    return _plan


def exported() -> dict[str, ExportedBackend]:
    """vLLM name → attnhost backend, for every name this process registered."""
    return dict(_ours)


def install() -> ExportPlan:
    """Register (or re-sync) attnhost's exports with vLLM; idempotent, safe in every process."""
    global _plan
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    with _lock:
        members = AttentionBackendEnum.__members__
        try:
            plan = plan_exports(
                "vLLM",
                lambda name: name in members and name not in _ours,
                override_env=OVERRIDE_ENV,
                to_engine_name=vllm_name,
                taken=tuple(_ours),
            )
        except Exception as exc:  # vLLM stops on it with a traceback; this line says what and why first
            _log_once(logging.ERROR, engine_load_failure("vLLM", exc))
            raise
        for warning in plan.warnings:
            _log_once(logging.WARNING, warning)
        added = []
        for backend in plan.backends:
            for name in backend.engine_names:
                if name in _ours:
                    continue
                path = class_path(name)
                if name in members:  # the operator's opt-in override of vLLM's own backend
                    register_backend(members[name], path)
                else:
                    register_backend(name, path)
                _ours[name] = backend
                added.append(name)
        added += _install_mla_names(plan, members, register_backend)
        _plan = plan
        if added:
            names = ", ".join(
                f"{name}{' (MLA)' if name in _mla_names.values() else ''}{' (draft)' if _ours[name].draft else ''}"
                + (f" as attnhost {_ours[name].name!r}" if name != vllm_name(_ours[name].name) else "")
                for name in added
            )
            _log_once(logging.INFO, f"attnhost registered {len(added)} vLLM attention backend(s): {names}")
        elif not _ours:
            _log_once(logging.INFO, "attnhost registered no vLLM attention backend (none implemented and available)")
        return plan


def _install_mla_names(plan: ExportPlan, members: Any, register_backend: Any) -> list[str]:
    """Register the MLA name of every exported backend that declares ``mla``; the names added."""
    mla, warnings = plan_mla_exports(plan, declares_mla, lambda name: name in members, _ours, vllm_name)
    for warning in warnings:
        _log_once(logging.WARNING, warning)
    added = []
    for export in mla:
        name = export.engine_name
        _mla_names[export.backend.engine_name] = name
        if name in _ours:
            continue
        path = class_path(name)
        register_backend(members[name] if export.overrides else name, path)
        _ours[name] = export.backend
        added.append(name)
    return added


def mla_name(engine_name: str) -> str | None:
    """The vLLM name under which the backend registered as ``engine_name`` serves MLA models, if it declares
    ``mla`` (``TORCH_NATIVE`` → ``TORCH_NATIVE_MLA``)."""
    install()
    return _mla_names.get(engine_name)


def registered_value(engine_name: str) -> str:
    """The enum value attnhost registered for ``engine_name`` in this process (registering first).

    Called while a spawned process unpickles a config that names an attnhost
    backend (see :mod:`attnhost.engines.vllm.names`).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    install()
    member = AttentionBackendEnum.__members__.get(engine_name)
    value = getattr(member, "value", None)
    if engine_name not in _ours or not isinstance(value, ClassPath):
        raise BackendUnavailableError(
            f"a vLLM config from another process names attention backend {engine_name!r}, which attnhost does "
            "not register in this one; install the same attnhost plugins and use the same ATTNHOST_* settings "
            "in every vLLM process (see `attnhost list`)"
        )
    return value


def backend_class(engine_name: str) -> type[Any]:
    """The vLLM backend class of one registered name, built once per process."""
    cls = _classes.get(engine_name)
    if cls is not None:
        return cls
    with _lock:
        if engine_name not in _ours:
            install()
        backend = _ours.get(engine_name)
        if backend is None:
            raise AttributeError(
                f"no attnhost backend is registered with vLLM as {engine_name!r} in this process; "
                "`attnhost list` shows the installed ones (vLLM spells them upper-case)"
            )
        cls = _classes.get(engine_name)
        if cls is None:
            if engine_name in _mla_names.values():
                from attnhost.engines.vllm.mla_adapter import make_mla_backend_class

                cls = make_mla_backend_class(engine_name, backend, backend.engine_name)
            else:
                from attnhost.engines.vllm.adapter import make_backend_class

                cls = make_backend_class(engine_name, backend, _mla_names.get(engine_name))
            _classes[engine_name] = cls
        return cls
