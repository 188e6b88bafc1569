"""The ``attnhost`` command: ``list``, ``resolve`` and ``plugins``.

Operators read this output when a server picks the wrong kernel, so it shows
where every backend came from and why each decision was made. Bad input is
one line on stderr and exit status 2; a strict-mode plugin failure is exit
status 1; a traceback is never printed unless ``ATTNHOST_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, cast

from attnhost.errors import AttnhostError, PlatformError, PluginLoadError, UnknownBackendError, printable
from attnhost.settings import (
    DEBUG_ENV,
    DISABLE_AUTOLOAD_ENV,
    NO_CACHE_ENV,
    PLATFORM_ENV,
    PLUGINS_ENV,
    STRICT_ENV,
    env_flag,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from attnhost.availability import Availability
    from attnhost.discovery import PluginInfo
    from attnhost.registry import BackendEntry

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
        return printable(f"attnhost: {record.levelname.lower()}: {record.getMessage()}")


class _Capture(logging.Filter):
    """Holds back the records of one logger, so a command can show them in its report instead (once)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.messages.append(record.getMessage())
        return False


def _json(payload: object, out: TextIO) -> int:
    import json  # only the --json paths need it

    # ensure_ascii (the default) escapes control characters and non-ASCII text alike: always valid, any stdout
    out.write(json.dumps(payload, indent=2) + "\n")
    return EXIT_OK


def _write(out: TextIO, lines: Sequence[str]) -> None:
    out.write("".join(line + "\n" for line in lines))


def _width(args: argparse.Namespace) -> int | None:
    """The width to lay out for: the terminal's, or unbounded with ``--wide``."""
    from attnhost.terminal import terminal_width

    return None if getattr(args, "wide", False) else terminal_width()


def _note(text: str, width: int | None, *, indent: str = "", hanging: str | None = None) -> list[str]:
    from attnhost.terminal import wrap

    if width is None:
        return [indent + printable(text)]
    return wrap(text, width, indent=indent, hanging=hanging)


def _platform_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--platform",
        metavar="P",
        default=None,
        help="pretend to run on P (cuda, rocm, xpu, npu, mps, cpu) instead of detecting it; "
        "ATTNHOST_PLATFORM does the same",
    )


def _wide_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wide", action="store_true", help="every column and the full text, however wide the terminal")


# -- list ----------------------------------------------------------------------------------


def _backend_rows(platform: str, draft_only: bool, available_only: bool) -> list[dict[str, Any]]:
    from attnhost.availability import check_availability
    from attnhost.host import get_registry

    registry = get_registry()
    rows = []
    for entry in registry.entries():
        if draft_only and not entry.draft:
            continue
        availability = check_availability(entry, platform)
        if available_only and not availability.available:
            continue
        rows.append(_backend_row(entry, availability))
    return rows


def _backend_row(entry: BackendEntry, availability: Availability) -> dict[str, Any]:
    return {
        "name": entry.name,
        "aliases": list(entry.spec.aliases),
        "roles": list(entry.roles),
        "plugin": entry.plugin,
        "distribution": entry.distribution,
        "version": entry.version,
        "implemented": entry.spec.implemented,
        "available": availability.available,
        "reason": availability.reason,
        "summary": availability.short,
        "description": entry.spec.description,
        "platforms": list(entry.spec.platforms),
        "requires": list(entry.spec.requires),
        "provided_by": entry.spec.provided_by,
        "declared_by": entry.declared_by,
    }


def _display_name(row: dict[str, Any]) -> str:
    name: str = row["name"]
    return name + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")


def _distribution(row: dict[str, Any]) -> str:
    return f"{row['distribution']} {row['version']}" if row["distribution"] else "(in-process)"


def _cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    from attnhost.host import default_host
    from attnhost.platform import current_platform, describe_detection

    platform = current_platform(args.platform)
    if args.name is not None:
        return _show_backend(args, platform, out)
    rows = _backend_rows(platform, args.draft, args.available)
    plugins = default_host().plugins()
    if args.json:
        return _json({"platform": platform, "backends": rows, "plugins": [p.to_json() for p in plugins]}, out)
    width = _width(args)
    lines = _list_table(rows, width) if rows else []
    source = "from --platform" if args.platform else describe_detection()
    usable = sum(1 for row in rows if row["available"])
    loaded = sum(1 for p in plugins if p.status.value == "loaded")
    which = " draft-capable" if args.draft else ""
    if args.available:
        summary = f"{len(rows)}{which} backend(s) can run on platform {platform} ({source})"
    else:
        summary = (
            f"platform {platform} ({source}); {len(rows)}{which} backends from {loaded} plugin(s), "
            f"{usable} available here"
        )
    lines += ["", *_note(summary, width)]
    problems = [p for p in plugins if p.status.value in ("failed", "duplicate")]
    if problems:
        lines += _note(f"{len(problems)} plugin(s) failed to load: see `attnhost plugins`", width)
    if width is not None and rows:
        lines += _note("`attnhost list NAME` shows one backend in full; `--wide` shows every column", width)
    _write(out, lines)
    return EXIT_OK


def _list_table(rows: list[dict[str, Any]], width: int | None) -> list[str]:
    """The compact table groups the reasons a backend cannot run into numbered notes below it."""
    from attnhost.terminal import fit_table

    if width is None:
        table = [["NAME", "ROLES", "PLUGIN", "DISTRIBUTION", "IMPLEMENTED", "AVAILABLE", "DESCRIPTION"]]
        for row in rows:
            available = "yes" if row["available"] else f"no: {row['reason']}"
            table.append(
                [
                    _display_name(row),
                    ",".join(row["roles"]),
                    row["plugin"],
                    _distribution(row),
                    "yes" if row["implemented"] else "no",
                    available,
                    row["description"],
                ]
            )
        return fit_table(table)
    reasons: dict[str, int] = {}
    table = [["NAME", "ROLES", "PLUGIN", "AVAILABLE"]]
    for row in rows:
        if row["available"]:
            available = "yes"
        else:
            number = reasons.setdefault(row["summary"] or "unknown", len(reasons) + 1)
            available = f"no [{number}]"
        table.append([_display_name(row), ",".join(row["roles"]), row["plugin"], available])
    lines = fit_table(table, width, flexible=(0, 2), wrap_last=False)
    if reasons:
        lines.append("")
    for reason, number in reasons.items():
        label = f"[{number}] "
        lines += _note(reason, width, indent=label, hanging=" " * len(label))
    return lines


def _show_backend(args: argparse.Namespace, platform: str, out: TextIO) -> int:
    """``attnhost list NAME``: every fact about one backend, one per line, wrapped to the terminal."""
    from attnhost.availability import check_availability
    from attnhost.host import get_registry
    from attnhost.terminal import fit_table

    registry = get_registry()
    entry = registry.entry(args.name)  # UnknownBackendError (with "did you mean") for a name nobody registered
    row = _backend_row(entry, check_availability(entry, platform))
    if args.json:
        return _json({"platform": platform, "backend": row}, out)
    available = "yes" if row["available"] else f"no: {row['reason']}"
    plugin = f"{row['plugin']} ({_distribution(row)})"
    if row["declared_by"] and row["declared_by"] != row["plugin"]:
        plugin += f"; the name was declared by {row['declared_by']}"
    facts = [
        ["name", row["name"]],
        ["aliases", ", ".join(row["aliases"]) or "-"],
        ["description", row["description"] or "-"],
        ["roles", ", ".join(row["roles"])],
        ["plugin", plugin],
        ["implemented", "yes" if row["implemented"] else "no (declared only)"],
        ["platforms", ", ".join(row["platforms"]) or "any"],
        ["requires", ", ".join(row["requires"]) or "-"],
        ["provided by", row["provided_by"] or "-"],
        [f"on {platform}", available],
    ]
    _write(out, fit_table(facts, _width(args)))
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
    status = _print_plugins(plugins, args.json, out, _width(args))
    host.registry()  # raises PluginLoadError under ATTNHOST_STRICT=1 if any plugin failed
    return status


def _print_plugins(plugins: Sequence[PluginInfo], as_json: bool, out: TextIO, width: int | None) -> int:
    from attnhost.terminal import fit_table

    if as_json:
        return _json({"plugins": [p.to_json() for p in plugins]}, out)
    table = [["PLUGIN", "DISTRIBUTION", "STATUS", "BACKENDS", "ENTRY POINT" if width else "ENTRY POINT / ERROR"]]
    errors: list[tuple[str, str]] = []
    for info in plugins:
        dist = f"{info.distribution} {info.version}" if info.distribution else "(in-process)"
        if width is None:
            backends = ",".join(info.backends)
            detail = info.value if info.error is None else f"{info.value}: {info.error}"
        else:
            shown = ",".join(info.backends[:2])
            backends = shown + (f",... ({len(info.backends)})" if len(info.backends) > 2 else "")
            detail = info.value
            if info.error is not None:
                errors.append((info.name, info.error))
        table.append([info.name, dist, info.status.value, backends or "-", detail])
    lines = fit_table(table, width, flexible=(0, 1, 3), wrap_last=False)
    if errors:
        lines.append("")
    for name, error in errors:
        label = f"{name}: "
        lines += _note(label + error, width, hanging="    ")
    for info in plugins:
        for warning in info.warnings:
            lines += _note(f"warning: {warning}", width, hanging="    ")
    _write(out, lines)
    return EXIT_OK


# -- resolve -------------------------------------------------------------------------------


def _cmd_resolve(args: argparse.Namespace, out: TextIO) -> int:
    from attnhost.availability import check_availability
    from attnhost.host import get_registry
    from attnhost.platform import current_platform
    from attnhost.resolution import resolve
    from attnhost.server_args import ServerArgs
    from attnhost.terminal import fit_table

    platform = current_platform(args.platform)
    server_args = ServerArgs.from_cli_args(args)
    # The text report lists every warning resolution raises; the log line would show each a second time.
    capture = _Capture()
    resolution_logger = logging.getLogger("attnhost.resolution")
    if not args.json:
        resolution_logger.addFilter(capture)
    try:
        result = resolve(server_args, platform)
    finally:
        resolution_logger.removeFilter(capture)
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
    width = _width(args)
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
    lines = fit_table(rows, width, flexible=(1,))
    lines += ["", "trace:"]
    for number, step in enumerate(result.target.trace + result.draft.trace, 1):
        label = f"  {number}. "
        lines += _note(step, width, indent=label, hanging=" " * len(label))
    warnings = list(dict.fromkeys([*result.warnings, *capture.messages]))
    if warnings:
        lines.append("warnings:")
        for warning in warnings:
            lines += _note(warning, width, indent="  - ", hanging="    ")
    _write(out, lines)
    return EXIT_OK


# -- main ---------------------------------------------------------------------------------

_ENVIRONMENT = (
    (PLUGINS_ENV, "comma-separated plugin names: load only these third-party plugins (the built-ins always load)"),
    (DISABLE_AUTOLOAD_ENV, "1: load only the built-in plugin"),
    (STRICT_ENV, "1: a plugin that fails to load is an error (exit 1), not a warning"),
    (PLATFORM_ENV, "cuda, rocm, xpu, npu, mps or cpu: the platform, instead of detecting it"),
    (NO_CACHE_ENV, "1: neither read nor write the entry-point scan cache"),
    (DEBUG_ENV, "1: show the traceback of an internal error"),
)


def _epilog(*names: str) -> str:
    """The environment variables a command reads, wrapped as argparse wraps the rest of ``--help``."""
    from attnhost.terminal import terminal_width, wrap

    width = terminal_width() - 2
    lines = ["environment variables:"]
    for name, text in _ENVIRONMENT:
        if not names or name in names:
            lines += [f"  {name}", *wrap(text, width, indent="      ")]
    return "\n".join(lines)


def _paragraph(text: str) -> str:
    from attnhost.terminal import terminal_width, wrap

    return "\n".join(wrap(text, terminal_width() - 2))


_LOADING = (PLUGINS_ENV, DISABLE_AUTOLOAD_ENV, STRICT_ENV, NO_CACHE_ENV, DEBUG_ENV)


def _subcommand(sub: Any, name: str, summary: str, description: str, env: Sequence[str]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=_paragraph(description),
        epilog=_epilog(*env),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnhost",
        description=_paragraph(
            "Inspect the attention backends attnhost discovers and resolves. With no command, runs `attnhost list` "
            "(with any flags given)."
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p_list = _subcommand(
        sub,
        "list",
        "every known attention backend, where it came from, and whether it runs here",
        "List every attention backend the installed plugins declare: its roles (target, draft), the plugin that "
        "registered it, and whether it can run on this platform. The table fits the terminal; reasons a backend "
        "cannot run are numbered notes below it. `attnhost list NAME` shows one backend in full.",
        (*_LOADING, PLATFORM_ENV),
    )
    p_list.add_argument("name", nargs="?", metavar="NAME", help="show this backend (or alias) in full")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.add_argument("--draft", action="store_true", help="only backends draft workers may use")
    p_list.add_argument("--available", action="store_true", help="only backends that can run here")
    _wide_arg(p_list)
    _platform_arg(p_list)
    p_list.set_defaults(handler=_cmd_list)
    p_plugins = _subcommand(
        sub,
        "plugins",
        "every discovered plugin and its status",
        "List every plugin found in the entry-point group sglang.draft_attention_backends, its distribution, "
        "its status (loaded, failed, blocked, not-allowed, duplicate), the backends it added, and why it failed.",
        _LOADING,
    )
    p_plugins.add_argument("--json", action="store_true", help="machine-readable output")
    _wide_arg(p_plugins)
    p_plugins.set_defaults(handler=_cmd_plugins)
    p_resolve = _subcommand(
        sub,
        "resolve",
        "which backends target and draft would run, and why",
        "Resolve SGLang's attention flags as a server would: the target's prefill and decode backends and the "
        "speculative draft worker's, with every step of the decision and whether each result can run here.",
        (*_LOADING, PLATFORM_ENV),
    )
    p_resolve.add_argument("--json", action="store_true", help="machine-readable output")
    _wide_arg(p_resolve)
    _platform_arg(p_resolve)
    if "resolve" in argv:
        # Building the flags loads plugins (their backends are the choices); only pay for it when needed.
        from attnhost.server_args import ServerArgs

        ServerArgs.add_cli_args(p_resolve)
    p_resolve.set_defaults(handler=_cmd_resolve)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> Any:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def _version() -> str:
    from attnhost import __version__

    return f"attnhost {__version__}"


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status instead of exiting, for tests and embedding.

    The ``attnhost`` logger's records go to ``err`` as ``attnhost: warning: ...``
    lines while it runs; the logger is left as it was found afterwards.
    """
    is_program = argv is None
    if is_program:  # the process's own streams: in-process callers' streams are theirs
        _tolerant(sys.stdout)
        _tolerant(sys.stderr)
    argv = list(sys.argv[1:] if argv is None else argv)
    err = err or sys.stderr or cast("TextIO", _Discard())
    if out is None and sys.stdout is None:  # started with stdout closed (`attnhost list >&-`)
        err.write("attnhost: write error: standard output is closed\n")
        return EXIT_FAILURE
    out = out or sys.stdout
    logger = logging.getLogger("attnhost")
    saved = (logger.level, logger.propagate)
    handler = logging.StreamHandler(err)
    handler.setFormatter(_WarningFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        status = _run(argv, out, err, is_program)
        return _flush(out, err, status, is_program)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


class _Discard:
    """Where messages go when even stderr is closed."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _tolerant(stream: TextIO | None) -> None:
    """Text the stream's encoding cannot carry (a plugin's non-ASCII name on an ASCII stdout) becomes escapes."""
    if isinstance(stream, io.TextIOWrapper):
        with contextlib.suppress(ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")


def _flush(out: TextIO, err: TextIO, status: int, is_program: bool) -> int:
    """Flush now, so a full disk or a closed pipe is reported here, once, and not at interpreter exit."""
    try:
        out.flush()
    except OSError as exc:
        return _write_failed(exc, out, err, is_program)
    return status


def _write_failed(exc: OSError, out: TextIO, err: TextIO, is_program: bool) -> int:
    if is_program and out is sys.stdout:
        # What Python's documentation recommends: point stdout at /dev/null, so the flush at exit
        # finds nothing left to fail on.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
    if isinstance(exc, BrokenPipeError):  # the reader left (`attnhost list | head`): nothing to say
        return EXIT_FAILURE
    reason = exc.strerror or type(exc).__name__
    with contextlib.suppress(OSError, ValueError):
        err.write(f"attnhost: write error: cannot write the output: {reason}\n")
    return EXIT_FAILURE


class _WriteError(Exception):
    """Writing the output failed (a full disk, a closed pipe): not the command's fault, nor a bug."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Output:
    """The command's output stream, telling write failures apart from every other ``OSError``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _WriteError(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise _WriteError(exc) from exc


def _run(argv: list[str], out: TextIO, err: TextIO, is_program: bool) -> int:
    def fail(message: str, status: int) -> int:
        err.write(printable(message.rstrip()) + "\n")
        return status

    debug = env_flag(DEBUG_ENV)
    try:
        parser = _build_parser(argv)
        args, extra = parser.parse_known_args(argv)
        if args.command is None:  # `attnhost` / `python -m attnhost` alone: the common question
            args, extra = parser.parse_known_args(["list", *argv])  # with list's own flags: `attnhost --json`
        if extra:  # reported by the command's own parser, so the hint names `attnhost COMMAND --help`
            _subparsers(parser).choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        handler: Callable[[argparse.Namespace, TextIO], int] = args.handler
        return handler(args, cast("TextIO", _Output(out)))
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, naming the plugin being loaded (PluginLoadInterrupted)
        return fail(f"attnhost: {str(exc) or 'interrupted'}", 130)
    except _UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0) if not isinstance(exc.code, str) else fail(exc.code, EXIT_USAGE)
    except _WriteError as exc:
        return _write_failed(exc.cause, out, err, is_program)
    except PluginLoadError as exc:
        return fail(f"attnhost: error: {exc}", EXIT_FAILURE)
    except (UnknownBackendError, PlatformError) as exc:
        return fail(f"attnhost: error: {exc}", EXIT_USAGE)
    except (AttnhostError, ValueError) as exc:
        if debug:
            raise
        status = EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE
        return fail(f"attnhost: error: {exc}", status)
    except Exception as exc:
        if debug:
            raise
        return fail(
            f"attnhost: internal error: {type(exc).__name__}: {exc}; rerun with ATTNHOST_DEBUG=1 for the "
            "traceback and report it",
            EXIT_FAILURE,
        )
