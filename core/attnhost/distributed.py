"""Check that every rank of a ``torch.distributed`` group runs the same attention plugins and backends.

Each rank discovers plugins from its own environment: one with another ``ATTNHOST_PLUGINS``, an older wheel or
a broken plugin would silently compute different attention. It never hangs on a rank's own fault: a fingerprint
cannot fail (a rank sends its error instead), so every rank reaches the one ``all_gather_object``; a rank that
never calls is bounded by the group's timeout (:class:`RankCheckError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from attnhost.errors import RankCheckError, RankMismatchError, describe_exception, plugin_label
from attnhost.host import default_host
from attnhost.platform import current_platform
from attnhost.resolution import resolve
from attnhost.server_args import ServerArgs

__all__ = ["RankCheckError", "RankFingerprint", "RankMismatchError", "check_ranks_agree", "compare_fingerprints"]

PluginRow = tuple[str, str | None, str | None, str]  # (name, distribution, version, status)
BackendRow = tuple[str, str, bool]  # (name, owning plugin, draft-capable)
RunnerRow = tuple[str, str | None, str | None, str | None]  # an engine's runner: (label, prefill, decode, draft)
# A mapping of ServerArgs fields is built on each rank, so a rank missing a backend they name reports it.
ArgsLike = ServerArgs | Mapping[str, Any] | None


@dataclass(frozen=True, slots=True)
class RankFingerprint:
    """What one rank would run: its plugins, its registry and its resolution; all but ``rank`` is compared."""

    rank: int = field(compare=False)
    platform: str | None
    plugins: tuple[PluginRow, ...]
    backends: tuple[BackendRow, ...]
    resolved: tuple[str, str, str] | None  # (prefill, decode, draft) for the args given to the check
    error: str | None = None  # why this rank could not load or resolve
    runners: tuple[RunnerRow, ...] = ()  # what an engine's model runners resolved (then ``resolved`` is None)


def _local_fingerprint(
    args: ArgsLike = None,
    *,
    platform: str | None = None,
    rank: int = 0,
    runners: Sequence[RunnerRow] | None = None,
    error: str | None = None,
) -> RankFingerprint:
    """This process's fingerprint; never raises for a plugin's or an argument's fault (it records it). With
    ``runners`` (as an engine resolved them) attnhost does not resolve: the engine's answer must agree."""
    host = default_host()
    plugins: tuple[PluginRow, ...] = ()
    resolved_platform: str | None = platform
    try:
        plugins = tuple((info.name, info.distribution, info.version, info.status.value) for info in host.plugins())
        resolved_platform = current_platform(platform)
        backends = tuple((entry.name, entry.plugin, entry.draft) for entry in host.registry().entries())
        if runners is not None:
            return RankFingerprint(rank, resolved_platform, plugins, backends, None, error, tuple(runners))
        server_args = args if isinstance(args, ServerArgs) else ServerArgs(**dict(args or {}))
        result = resolve(server_args, resolved_platform)
    except Exception as exc:  # reported to every rank instead of skipping the collective
        return RankFingerprint(rank, resolved_platform, plugins, (), None, describe_exception(exc))
    resolved = (result.target.prefill, result.target.decode, result.draft.name)
    return RankFingerprint(rank, resolved_platform, plugins, backends, resolved)


def _describe_differences(ref: RankFingerprint, other: RankFingerprint) -> str:
    """``rank 2 differs from rank 0: ...``: one clause per difference, on one line."""
    parts: list[str] = []
    if other.error != ref.error:
        if other.error:
            parts.append(f"it could not resolve ({other.error})")
        if ref.error:
            parts.append(f"rank {ref.rank} could not resolve ({ref.error})")
    if other.platform != ref.platform:
        parts.append(f"platform {other.platform!r} vs {ref.platform!r}")
    mine, theirs = ({row[0]: row for row in fp.plugins} for fp in (ref, other))
    for name in sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n)):
        a, b = mine.get(name), theirs.get(name)
        if b is None:
            assert a is not None
            parts.append(f"{plugin_label(*a[:3])} missing (rank {ref.rank}: {a[3]})")
        elif a is None:
            parts.append(f"{plugin_label(*b[:3])} extra ({b[3]}; rank {ref.rank} has no such plugin)")
        elif a[1:3] != b[1:3]:
            parts.append(f"plugin {name!r} is {b[1]} {b[2]} on rank {other.rank} but {a[1]} {a[2]} on rank {ref.rank}")
        else:
            parts.append(f"{plugin_label(*b[:3])} is {b[3]} on rank {other.rank} but {a[3]} on rank {ref.rank}")
    if not (ref.error or other.error):  # a rank that could not build its registry has no backends to compare
        mine_b, theirs_b = ({row[0]: row for row in fp.backends} for fp in (ref, other))
        if missing := sorted(mine_b.keys() - theirs_b.keys()):
            parts.append(f"backends missing: {', '.join(missing)}")
        if extra := sorted(theirs_b.keys() - mine_b.keys()):
            parts.append(f"extra backends: {', '.join(extra)}")
        for name in sorted(mine_b.keys() & theirs_b.keys()):
            (_, plugin_a, draft_a), (_, plugin_b, draft_b) = mine_b[name], theirs_b[name]
            if plugin_a != plugin_b:
                parts.append(
                    f"backend {name!r} comes from plugin {plugin_b!r} on rank {other.rank} "
                    f"but from {plugin_a!r} on rank {ref.rank}"
                )
            elif draft_a != draft_b:
                capable = "draft-capable" if draft_b else "not draft-capable"
                parts.append(f"backend {name!r} is {capable} on rank {other.rank}, unlike on rank {ref.rank}")
    for ref_runner, runner in zip(ref.runners, other.runners, strict=False):
        roles = zip(("prefill", "decode", "draft"), ref_runner[1:], runner[1:], strict=True)
        parts += [
            f"{runner[0]} resolved {role} {y!r} on rank {other.rank}, {x!r} on rank {ref.rank}"
            for role, x, y in roles
            if x != y
        ]
    if len(ref.runners) != len(other.runners):
        parts.append(f"{len(other.runners)} model runner(s) vs {len(ref.runners)}")
    if ref.resolved and other.resolved:
        pairs = zip(("prefill", "decode", "draft"), ref.resolved, other.resolved, strict=True)
        parts += [f"{role} {b!r} vs {a!r}" for role, a, b in pairs if a != b]
    return f"rank {other.rank} differs from rank {ref.rank}: " + "; ".join(parts or ["(unknown difference)"])


def compare_fingerprints(fingerprints: Sequence[RankFingerprint]) -> str | None:
    """None if all agree, else the message naming every rank that differs from the lowest rank."""
    ordered = sorted(fingerprints, key=lambda fp: fp.rank)
    differing = [fp for fp in ordered[1:] if fp != ordered[0]]
    if not differing:
        return None
    ref = ordered[0]
    ranks = ", ".join(str(fp.rank) for fp in differing)
    details = " | ".join(_describe_differences(ref, fp) for fp in differing)
    return (
        f"attention plugins or backends differ across ranks (rank(s) {ranks} vs rank {ref.rank}): {details} "
        "— install the same plugin packages on every rank and give every rank the same ATTNHOST_* settings "
        "and attention-backend arguments"
    )


def check_ranks_agree(
    args: ArgsLike = None,
    *,
    group: Any = None,
    platform: str | None = None,
    runners: Sequence[RunnerRow] | None = None,
    error: str | None = None,
) -> tuple[RankFingerprint, ...]:
    """Collective: every rank of ``group`` must call it; returns every rank's fingerprint if all agree. An engine bridge
    passes ``runners`` (what its model runners resolved, compared instead of resolving ``args``) and ``error`` (this
    rank's failure to build them, sent rather than skipping the collective)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RankCheckError("check_ranks_agree needs an initialised torch.distributed process group")
    mine = _local_fingerprint(args, platform=platform, rank=dist.get_rank(), runners=runners, error=error)
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
    if (problem := compare_fingerprints(fingerprints)) is not None:
        raise RankMismatchError(problem)
    return tuple(sorted(fingerprints, key=lambda fp: fp.rank))
