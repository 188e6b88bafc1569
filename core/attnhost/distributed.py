"""Check that every rank of a ``torch.distributed`` group runs the same attention plugins and backends.

Each rank of a tensor-parallel server discovers plugins on its own, from its
own environment. One rank with a different ``ATTNHOST_PLUGINS``, an older
wheel or a broken plugin would silently resolve a different kernel, and the
ranks would then compute different attention. :func:`check_ranks_agree`
gathers a small fingerprint from every rank — the plugins it discovered
(name, distribution, version, status), the backends it registered and the
backends it resolved — and raises the same :class:`RankMismatchError` on
every rank when they differ, naming the ranks and the differences.

It never hangs on a rank's own fault: computing the fingerprint cannot raise
before the collective (a rank that cannot resolve sends its error instead),
so every rank reaches the one ``all_gather_object``. A rank that never calls
the check at all is bounded by the process group's timeout
(``init_process_group(timeout=...)`` / ``new_group(timeout=...)``), and the
collective's failure is re-raised as :class:`RankCheckError`.

``torch`` is imported only when the check runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from attnhost.errors import RankCheckError, RankMismatchError, describe_exception, plugin_label

if TYPE_CHECKING:
    from attnhost.server_args import ServerArgs

__all__ = [
    "RankCheckError",
    "RankFingerprint",
    "RankMismatchError",
    "check_ranks_agree",
    "compare_fingerprints",
    "describe_differences",
    "local_fingerprint",
]

PluginRow = tuple[str, str | None, str | None, str]
"""``(name, distribution, version, status)`` of one discovered plugin."""

BackendRow = tuple[str, str, bool]
"""``(name, owning plugin, draft-capable)`` of one registered backend."""


@dataclass(frozen=True, slots=True)
class RankFingerprint:
    """What one rank would run: its plugins, its registry and its resolution (or why it has none)."""

    rank: int = field(compare=False)
    """Which rank this is; the rest is compared (``==``) across ranks."""
    platform: str | None
    plugins: tuple[PluginRow, ...]
    backends: tuple[BackendRow, ...]
    resolved: tuple[str, str, str] | None
    """``(prefill, decode, draft)`` for the args given to the check."""
    error: str | None = None
    """Why this rank could not load or resolve (a strict-mode failure, an unknown backend, ...)."""


ArgsLike = Union["ServerArgs", Mapping[str, Any], None]
"""What the check resolves: ``ServerArgs``, a mapping of its fields, or None for the defaults."""


def local_fingerprint(args: ArgsLike = None, *, platform: str | None = None, rank: int = 0) -> RankFingerprint:
    """This process's fingerprint; never raises for a plugin's or an argument's fault (it records it).

    ``args`` is a ``ServerArgs``, or a mapping of ``ServerArgs`` fields built
    here — so a rank missing a backend named in them reports that instead of
    failing before the collective. ``None`` means default ``ServerArgs()``.
    """
    from attnhost.host import default_host

    host = default_host()
    plugins: tuple[PluginRow, ...] = ()
    resolved_platform: str | None = platform
    try:
        plugins = tuple((info.name, info.distribution, info.version, info.status.value) for info in host.plugins())
        from attnhost.platform import current_platform
        from attnhost.resolution import resolve
        from attnhost.server_args import ServerArgs

        resolved_platform = current_platform(platform)
        registry = host.registry()
        backends = tuple((entry.name, entry.plugin, entry.draft) for entry in registry.entries())
        server_args = args if isinstance(args, ServerArgs) else ServerArgs(**dict(args or {}))
        result = resolve(server_args, resolved_platform)
    except Exception as exc:  # reported to every rank instead of skipping the collective
        return RankFingerprint(rank, resolved_platform, plugins, (), None, describe_exception(exc))
    return RankFingerprint(
        rank,
        resolved_platform,
        plugins,
        backends,
        (result.target.prefill, result.target.decode, result.draft.name),
    )


def _plugin_differences(ref: RankFingerprint, other: RankFingerprint) -> list[str]:
    mine = {row[0]: row for row in ref.plugins}
    theirs = {row[0]: row for row in other.plugins}
    out = []
    for name in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(name), theirs.get(name)
        if a == b:
            continue
        if b is None:
            assert a is not None
            out.append(f"{plugin_label(*a[:3])} missing (rank {ref.rank}: {a[3]})")
        elif a is None:
            out.append(f"{plugin_label(*b[:3])} extra ({b[3]}; rank {ref.rank} has no such plugin)")
        elif a[1:3] != b[1:3]:
            out.append(f"plugin {name!r} is {b[1]} {b[2]} on rank {other.rank} but {a[1]} {a[2]} on rank {ref.rank}")
        else:
            out.append(f"{plugin_label(*b[:3])} is {b[3]} on rank {other.rank} but {a[3]} on rank {ref.rank}")
    return out


def _backend_differences(ref: RankFingerprint, other: RankFingerprint) -> list[str]:
    if ref.error or other.error:
        return []  # a rank that could not build its registry has no backends to compare
    mine = {row[0]: row for row in ref.backends}
    theirs = {row[0]: row for row in other.backends}
    out = []
    missing = sorted(mine.keys() - theirs.keys())
    extra = sorted(theirs.keys() - mine.keys())
    if missing:
        out.append(f"backends missing: {', '.join(missing)}")
    if extra:
        out.append(f"extra backends: {', '.join(extra)}")
    for name in sorted(mine.keys() & theirs.keys()):
        (_, plugin_a, draft_a), (_, plugin_b, draft_b) = mine[name], theirs[name]
        if plugin_a != plugin_b:
            out.append(
                f"backend {name!r} comes from plugin {plugin_b!r} on rank {other.rank} "
                f"but from {plugin_a!r} on rank {ref.rank}"
            )
        elif draft_a != draft_b:
            capable = "draft-capable" if draft_b else "not draft-capable"
            out.append(f"backend {name!r} is {capable} on rank {other.rank}, unlike on rank {ref.rank}")
    return out


def describe_differences(ref: RankFingerprint, other: RankFingerprint) -> str:
    """``rank 2 differs from rank 0: ...``: one clause per difference, on one line."""
    parts: list[str] = []
    if other.error != ref.error:
        if other.error:
            parts.append(f"it could not resolve ({other.error})")
        if ref.error:
            parts.append(f"rank {ref.rank} could not resolve ({ref.error})")
    if other.platform != ref.platform:
        parts.append(f"platform {other.platform!r} vs {ref.platform!r}")
    parts += _plugin_differences(ref, other)
    parts += _backend_differences(ref, other)
    if other.resolved != ref.resolved and other.resolved is not None and ref.resolved is not None:
        for role, a, b in zip(("prefill", "decode", "draft"), ref.resolved, other.resolved, strict=True):
            if a != b:
                parts.append(f"{role} {b!r} vs {a!r}")
    return f"rank {other.rank} differs from rank {ref.rank}: " + "; ".join(parts or ["(unknown difference)"])


def compare_fingerprints(fingerprints: Sequence[RankFingerprint]) -> str | None:
    """None if all agree, else the message naming every rank that differs from the lowest rank."""
    if not fingerprints:
        return None
    ordered = sorted(fingerprints, key=lambda fp: fp.rank)
    ref = ordered[0]
    differing = [fp for fp in ordered[1:] if fp != ref]
    if not differing:
        return None
    ranks = ", ".join(str(fp.rank) for fp in differing)
    details = " | ".join(describe_differences(ref, fp) for fp in differing)
    return (
        f"attention plugins or backends differ across ranks (rank(s) {ranks} vs rank {ref.rank}): {details} "
        "— give every rank the same installed plugins and ATTNHOST_* settings"
    )


def check_ranks_agree(
    args: ArgsLike = None,
    *,
    group: Any = None,
    platform: str | None = None,
) -> tuple[RankFingerprint, ...]:
    """Collective: every rank of ``group`` must call it; returns every rank's fingerprint if all agree.

    Raises :class:`RankMismatchError` on every rank when any rank differs
    (the same message everywhere), and :class:`RankCheckError` if the
    collective itself fails (e.g. a rank never joins before the group's
    timeout). ``args`` as for :func:`local_fingerprint`: pass a mapping of
    ``ServerArgs`` fields when a rank may lack one of the named backends.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RankCheckError("check_ranks_agree needs an initialised torch.distributed process group")
    mine = local_fingerprint(args, platform=platform, rank=dist.get_rank())
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except Exception as exc:
        raise RankCheckError(
            f"rank {mine.rank}: gathering every rank's attention fingerprint failed ({describe_exception(exc)}); "
            "every rank of the group must call check_ranks_agree, within the group's timeout"
        ) from exc
    fingerprints = tuple(fp for fp in gathered if isinstance(fp, RankFingerprint))
    if len(fingerprints) != len(gathered):
        raise RankCheckError(f"rank {mine.rank}: some ranks sent no fingerprint (different attnhost versions?)")
    problem = compare_fingerprints(fingerprints)
    if problem is not None:
        raise RankMismatchError(problem)
    return tuple(sorted(fingerprints, key=lambda fp: fp.rank))
