"""The ``attnhost`` command: ``list``, ``resolve`` and ``plugins``.

Operators read this output when a server picks the wrong kernel, so it shows
where every backend came from and why each decision was made. Bad input is
one line on stderr and exit status 2; a strict-mode plugin failure is exit
status 1; a traceback is never printed unless ``ATTNHOST_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from attnhost.errors import AttnhostError, PlatformError, PluginLoadError, UnknownBackendError
from attnhost.settings import DEBUG_ENV, env_flag

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from attnhost.discovery import PluginInfo

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message} (see `{self.prog} --help`)")


class _WarningFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"attnhost: {record.levelname.lower()}: {record.getMessage()}"


def _json(payload: object, out: TextIO) -> int:
    import json  # only the --json paths need it

    out.write(json.dumps(payload, indent=2) + "\n")
    return EXIT_OK


def _table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        out.write("  ".join(cells).rstrip() + "\n")


def _platform_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--platform",
        metavar="P",
        default=None,
        help="pretend to run on P (cuda, rocm, xpu, npu, mps, cpu) instead of detecting it; "
        "ATTNHOST_PLATFORM does the same",
    )


# -- list ----------------------------------------------------------------------------------


def _backend_rows(platform: str, draft_only: bool) -> list[dict[str, Any]]:
    from attnhost.availability import check_availability
    from attnhost.host import get_registry

    registry = get_registry()
    rows = []
    for entry in registry.entries():
        if draft_only and not entry.draft:
            continue
        availability = check_availability(entry, platform)
        rows.append(
            {
                "name": entry.name,
                "aliases": list(entry.spec.aliases),
                "roles": list(entry.roles),
                "plugin": entry.plugin,
                "distribution": entry.distribution,
                "version": entry.version,
                "implemented": entry.spec.implemented,
                "available": availability.available,
                "reason": availability.reason,
                "description": entry.spec.description,
                "platforms": list(entry.spec.platforms),
                "requires": list(entry.spec.requires),
                "provided_by": entry.spec.provided_by,
                "declared_by": entry.declared_by,
            }
        )
    return rows


def _cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    from attnhost.host import default_host
    from attnhost.platform import current_platform, describe_detection

    platform = current_platform(args.platform)
    rows = _backend_rows(platform, args.draft)
    plugins = default_host().plugins()
    if args.json:
        return _json({"platform": platform, "backends": rows, "plugins": [p.to_json() for p in plugins]}, out)
    table = [["NAME", "ROLES", "PLUGIN", "DISTRIBUTION", "IMPLEMENTED", "AVAILABLE"]]
    for row in rows:
        name = row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else "(in-process)"
        available = "yes" if row["available"] else f"no: {row['reason']}"
        table.append(
            [name, ",".join(row["roles"]), row["plugin"], dist, "yes" if row["implemented"] else "no", available]
        )
    _table(table, out)
    source = "from --platform" if args.platform else describe_detection()
    usable = sum(1 for row in rows if row["available"])
    loaded = sum(1 for p in plugins if p.status.value == "loaded")
    out.write(
        f"\nplatform {platform} ({source}); {len(rows)} backends from {loaded} plugin(s), {usable} available here\n"
    )
    problems = [p for p in plugins if p.status.value in ("failed", "duplicate")]
    if problems:
        out.write(f"{len(problems)} plugin(s) failed to load: see `attnhost plugins`\n")
    return EXIT_OK


# -- plugins -------------------------------------------------------------------------------


def _cmd_plugins(args: argparse.Namespace, out: TextIO) -> int:
    """Show every plugin, even in strict mode: this is the command for debugging a failure.

    Under ``ATTNHOST_STRICT=1`` the report is printed first and the strict
    error (naming every failed plugin) then ends the command with status 1.
    """
    from attnhost.host import default_host

    host = default_host()
    plugins = host.plugins()
    status = _print_plugins(plugins, args.json, out)
    host.registry()  # raises PluginLoadError under ATTNHOST_STRICT=1 if any plugin failed
    return status


def _print_plugins(plugins: Sequence[PluginInfo], as_json: bool, out: TextIO) -> int:
    if as_json:
        return _json({"plugins": [p.to_json() for p in plugins]}, out)
    table = [["PLUGIN", "DISTRIBUTION", "STATUS", "BACKENDS", "ENTRY POINT / ERROR"]]
    for info in plugins:
        dist = f"{info.distribution} {info.version}" if info.distribution else "(in-process)"
        detail = info.value if info.error is None else f"{info.value}: {info.error}"
        backends = ",".join(info.backends[:3]) + (f",... ({len(info.backends)})" if len(info.backends) > 3 else "")
        table.append([info.name, dist, info.status.value, backends or "-", detail])
    _table(table, out)
    for info in plugins:
        for warning in info.warnings:
            out.write(f"warning: {warning}\n")
    return EXIT_OK


# -- resolve -------------------------------------------------------------------------------


def _cmd_resolve(args: argparse.Namespace, out: TextIO) -> int:
    from attnhost.availability import check_availability
    from attnhost.host import get_registry
    from attnhost.platform import current_platform
    from attnhost.resolution import resolve
    from attnhost.server_args import ServerArgs

    platform = current_platform(args.platform)
    server_args = ServerArgs.from_cli_args(args)
    result = resolve(server_args, platform)
    registry = get_registry()
    availability = {
        role: check_availability(registry.entry(name), platform)
        for role, name in (
            ("prefill", result.target.prefill),
            ("decode", result.target.decode),
            ("draft", result.draft.name),
        )
    }
    if args.json:
        payload = result.to_json()
        payload["availability"] = {
            role: {"available": a.available, "reason": a.reason} for role, a in availability.items()
        }
        return _json(payload, out)
    rows = [
        ["platform", platform, "(from --platform)" if args.platform else ""],
        ["prefill", result.target.prefill, ""],
        ["decode", result.target.decode, ""],
        ["draft", result.draft.name, "(fell back)" if result.draft.fell_back else ""],
    ]
    for row in rows[1:]:
        a = availability[row[0]]
        if not a.available:
            row[2] = (row[2] + " " if row[2] else "") + f"[not available here: {a.reason}]"
    _table(rows, out)
    out.write("\ntrace:\n")
    for number, step in enumerate(result.target.trace + result.draft.trace, 1):
        out.write(f"  {number}. {step}\n")
    if result.warnings:
        out.write("warnings:\n")
        for warning in result.warnings:
            out.write(f"  - {warning}\n")
    return EXIT_OK


# -- main ----------------------------------------------------------------------------------


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="attnhost", description="Inspect the attention backends attnhost discovers and resolves.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p_list = sub.add_parser("list", help="every known attention backend, where it came from, and whether it runs here")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.add_argument("--draft", action="store_true", help="only backends draft workers may use")
    _platform_arg(p_list)
    p_list.set_defaults(handler=_cmd_list)
    p_plugins = sub.add_parser("plugins", help="every discovered plugin and its status")
    p_plugins.add_argument("--json", action="store_true", help="machine-readable output")
    p_plugins.set_defaults(handler=_cmd_plugins)
    p_resolve = sub.add_parser("resolve", help="which backends target and draft would run, and why")
    p_resolve.add_argument("--json", action="store_true", help="machine-readable output")
    _platform_arg(p_resolve)
    if "resolve" in argv:
        # Building the flags loads plugins (their backends are the choices); only pay for it when needed.
        from attnhost.server_args import ServerArgs

        ServerArgs.add_cli_args(p_resolve)
    p_resolve.set_defaults(handler=_cmd_resolve)
    return parser


def _version() -> str:
    from attnhost import __version__

    return f"attnhost {__version__}"


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status instead of exiting, for tests and embedding.

    The ``attnhost`` logger's records go to ``err`` as ``attnhost: warning: ...``
    lines while it runs; the logger is left as it was found afterwards.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    out = out or sys.stdout
    err = err or sys.stderr
    logger = logging.getLogger("attnhost")
    saved = (logger.level, logger.propagate)
    handler = logging.StreamHandler(err)
    handler.setFormatter(_WarningFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        return _run(argv, out, err)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _run(argv: list[str], out: TextIO, err: TextIO) -> int:
    def fail(message: str, status: int) -> int:
        err.write(message.rstrip() + "\n")
        return status

    debug = env_flag(DEBUG_ENV)
    try:
        args = _build_parser(argv).parse_args(argv)
        handler: Callable[[argparse.Namespace, TextIO], int] = args.handler
        return handler(args, out)
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, naming the plugin being loaded (PluginLoadInterrupted)
        return fail(f"attnhost: {str(exc) or 'interrupted'}", 130)
    except _UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0) if not isinstance(exc.code, str) else fail(exc.code, EXIT_USAGE)
    except PluginLoadError as exc:
        return fail(f"attnhost: error: {exc}", EXIT_FAILURE)
    except (UnknownBackendError, PlatformError) as exc:
        return fail(f"attnhost: error: {exc}", EXIT_USAGE)
    except (AttnhostError, ValueError) as exc:
        if debug:
            raise
        status = EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE
        return fail(f"attnhost: error: {exc}", status)
    except BrokenPipeError:
        return EXIT_FAILURE
    except Exception as exc:
        if debug:
            raise
        return fail(
            f"attnhost: internal error: {type(exc).__name__}: {exc}; rerun with ATTNHOST_DEBUG=1 for the "
            "traceback and report it",
            EXIT_FAILURE,
        )
