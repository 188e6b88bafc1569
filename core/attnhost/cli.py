"""The ``attnhost`` command (``list``, ``resolve``, ``plugins``), read when a server picks the wrong kernel: so it
shows where every backend came from and why each decision was made, and never a traceback (``ATTNHOST_DEBUG=1``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from attnhost import __version__, settings
from attnhost.errors import AttnhostError, PlatformError, PluginLoadError, UnknownBackendError, bounded, printable
from attnhost.terminal import ENCODING, fit_table, terminal_width, wrap

if TYPE_CHECKING:
    from attnhost.registry import BackendEntry

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"attnhost: error: {message} (see `{self.prog} --help`)")  # exit status 2; one prefix


class _WarningFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return bounded(printable(f"attnhost: {record.levelname.lower()}: {record.getMessage()}"), 2000)


def _distribution(name: str | None, version: str | None) -> str:
    return f"{name} {version}" if name else "(in-process)"


def _backend_row(entry: BackendEntry, platform: str) -> dict[str, Any]:
    from attnhost.availability import check_availability

    availability = check_availability(entry, platform)
    factory = entry.spec.factory
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
        "factory": factory if isinstance(factory, str) or factory is None else _qualname(factory),
    }


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _fallback_on(name: str) -> list[str]:
    """The platforms whose draft fallback (hook ``attnhost_draft_fallback``) is ``name``, each with its source."""
    from attnhost.host import get_registry
    from attnhost.platform import KNOWN_PLATFORMS
    from attnhost.resolution import ask_platform_hook

    answers = {p: ask_platform_hook("attnhost_draft_fallback", p, get_registry(), draft=True) for p in KNOWN_PLATFORMS}
    return [f"{platform} ({source})" for platform, (answer, source) in answers.items() if answer == name]


def _declared_capabilities(entry: BackendEntry, row: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """What the backend declares (``BackendCapabilities``, a class attribute: reading it imports the backend, so
    only the one-backend view does), or why it was not read."""
    if not row["implemented"]:
        return None, "declared only: no implementation to read them from"
    if not row["available"]:
        return None, "not read: the backend is not available here, and reading them imports it"
    from dataclasses import fields

    from attnhost.errors import describe_exception

    try:
        from attnhost.backend import capabilities_of

        declared = capabilities_of(entry.spec.load())
    except Exception as exc:
        return None, f"could not be read: {describe_exception(exc)}"
    return {f.name: _plain(getattr(declared, f.name)) for f in fields(declared)}, None


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


_FLAGS_SHOWN = (
    ("cuda_graph", "graphs"),
    ("tree_mask", "trees"),
    ("mla", "MLA"),
    ("sliding_window", "windows"),
    ("logit_cap", "soft-caps"),
    ("sinks", "sinks"),
    ("non_causal", "non-causal"),
    ("flat_heads", "flat heads"),
)


def _capability_facts(row: dict[str, Any]) -> list[list[str]]:
    caps = row["capabilities"]
    if caps is None:
        return [["capabilities", row["capabilities_unread"]]]
    declared = [shown for flag, shown in _FLAGS_SHOWN if caps[flag]]
    missing = [shown for flag, shown in _FLAGS_SHOWN if not caps[flag]]
    cache = caps["kv_cache_dtypes"]
    return [
        ["dtypes", ", ".join(caps["dtypes"])],
        ["head dims", ", ".join(map(str, caps["head_dims"])) or "any"],
        ["page sizes", "any" if caps["page_sizes"] is None else ", ".join(map(str, caps["page_sizes"]))],
        ["cache dtypes", "its dtypes (no FP8)" if cache is None else ", ".join(cache)],
        ["declares", ", ".join(declared) or "-"],
        ["not declared", ", ".join(missing) or "-"],
    ]


def _available(row: dict[str, Any]) -> str:
    return "yes" if row["available"] else f"no: {row['reason']}"


def _cmd_list(args: argparse.Namespace, width: int | None) -> list[str] | dict[str, Any]:
    from attnhost.host import default_host, get_registry
    from attnhost.platform import TORCH_HINT, current_platform, describe_detection, module_installed

    platform = current_platform(args.platform)
    registry = get_registry()
    if args.name is not None:
        row = _backend_row(registry.entry(args.name), platform)  # UnknownBackendError, with "did you mean"
        row["draft_fallback_on"] = _fallback_on(row["name"]) if registry.is_draft_capable(row["name"]) else []
        row["capabilities"], row["capabilities_unread"] = _declared_capabilities(registry.entry(args.name), row)
        return {"platform": platform, "backend": row} if args.json else fit_table(_facts(row, platform, width), width)
    rows = [_backend_row(entry, platform) for entry in registry.entries() if entry.draft or not args.draft]
    notes: list[str] = []  # what the rows cannot say; the same sentences in the text and in --json
    if args.available:
        rows = [row for row in rows if row["available"]]
        if not rows and not module_installed("torch"):  # every backend that runs attention needs it
            notes.append(f"nothing can run on platform {platform} until torch is installed: {TORCH_HINT}")
    plugins = default_host().plugins()
    if args.json:  # one shape whatever the answer: scripts read the keys, never guess the type
        return {"platform": platform, "backends": rows, "plugins": [p.to_json() for p in plugins], "notes": notes}
    if notes and not rows:
        return [line for note in notes for line in wrap(note, width)]
    every = ["NAME", "ROLES", "PLUGIN", "DISTRIBUTION", "IMPLEMENTED", "AVAILABLE", "DESCRIPTION"]
    table = [every if width is None else ["NAME", "ROLES", "PLUGIN", "AVAILABLE"]]
    reasons: dict[str, int] = {}
    for row in rows:
        aliases = f" ({', '.join(row['aliases'])})" if row["aliases"] else ""
        cells = [row["name"] + aliases, ",".join(row["roles"]), row["plugin"]]
        if width is None:
            dist = _distribution(row["distribution"], row["version"])
            cells += [dist, "yes" if row["implemented"] else "no", _available(row), row["description"] or "-"]
        elif row["available"]:
            cells.append("yes")
        else:
            cells.append(f"no [{reasons.setdefault(row['summary'] or 'unknown', len(reasons) + 1)}]")
        table.append(cells)
    lines = fit_table(table, width, whole=(0, 2), wrap_last=False) if rows else []  # the wide table has no notes
    lines += [""] if reasons else []
    for reason, number in reasons.items():
        lines += wrap(reason, width, indent=f"[{number}] ")
    source = "from --platform" if args.platform else describe_detection()
    which = " draft-capable" if args.draft else ""
    if args.available:
        summary = f"{len(rows)}{which} backend(s) can run on platform {platform} ({source})"
    else:
        loaded = sum(1 for p in plugins if p.status.value == "loaded")
        usable = sum(1 for row in rows if row["available"])
        summary = (
            f"platform {platform} ({source}); {len(rows)}{which} backends from {loaded} plugin(s), "
            f"{usable} available here"
        )
    lines += ["", *wrap(summary, width)]
    if problems := [p for p in plugins if p.status.value in ("failed", "duplicate")]:
        lines += wrap(f"{len(problems)} plugin(s) failed to load: see `attnhost plugins`", width)
    if width is not None and rows:
        lines += wrap("`attnhost list NAME` shows one backend in full; `--wide` shows every column", width)
    return lines


def _facts(row: dict[str, Any], platform: str, width: int | None) -> list[list[str]]:
    plugin = f"{row['plugin']} ({_distribution(row['distribution'], row['version'])})"
    if row["declared_by"] and row["declared_by"] != row["plugin"]:
        plugin += f"; the name was declared by {row['declared_by']}"
    return [
        ["name", row["name"]],
        ["aliases", ", ".join(row["aliases"]) or "-"],
        ["description", row["description"] or "-"],
        ["roles", ", ".join(row["roles"])],
        ["plugin", plugin],
        ["implemented", "yes" if row["implemented"] else "no (declared only)"],
        ["platforms", ", ".join(row["platforms"]) or "any"],
        ["requires", ", ".join(row["requires"]) or "-"],
        ["provided by", row["provided_by"] or "-"],
        ["draft fallback", "on " + "; ".join(row["draft_fallback_on"]) if row["draft_fallback_on"] else "-"],
        *([["factory", row["factory"] or "-"]] if width is None else []),
        [f"on {platform}", _available(row)],
        *_capability_facts(row),
    ]


def _cmd_versions(args: argparse.Namespace, width: int | None) -> list[str] | dict[str, Any]:
    """torch and the engines installed here against the versions attnhost is tested with (``versions.TESTED``)."""
    from attnhost.versions import TESTED, installed

    found = [installed(distribution) for distribution in TESTED]
    if args.json:
        return {"versions": [f.to_json() for f in found]}
    table = [["DISTRIBUTION", "INSTALLED", "TESTED WITH", "IN WINDOW"]]
    for f in found:
        window = "-" if f.in_window is None else "yes" if f.in_window else "no"
        table.append([f.distribution, f.version or "not installed", f.tested, window])
    lines = fit_table(table, width)
    outside = [f"{f.distribution} {f.version}" for f in found if f.in_window is False]
    if outside:
        note = (
            f"{', '.join(outside)}: outside what attnhost is tested with; it runs, but say so when you report a problem"
        )
        lines += ["", *wrap(note, width)]
    return lines


def _cmd_plugins(args: argparse.Namespace, width: int | None) -> list[str] | dict[str, Any]:
    from attnhost.host import default_host

    plugins = default_host().plugins()  # every plugin, even in strict mode: the command for debugging a failure
    if args.json:
        return {"plugins": [p.to_json() for p in plugins]}
    table = [["PLUGIN", "DISTRIBUTION", "STATUS", "BACKENDS", "ENTRY POINT" if width else "ENTRY POINT / ERROR"]]
    errors: list[str] = []
    for info in plugins:
        backends, detail = ",".join(info.backends), info.value
        if width is None and info.error is not None:
            detail += f": {info.error}"
        elif info.error is not None:
            errors += wrap(f"{info.name}: {info.error}", width, hanging="    ")
        if width is not None and len(info.backends) > 2:
            backends = ",".join(info.backends[:2]) + f",... ({len(info.backends)})"
        dist = _distribution(info.distribution, info.version)
        table.append([info.name, dist, info.status.value, backends or "-", detail])
    lines = fit_table(table, width, flexible=(3, 4), whole=(0, 1), wrap_last=False)
    lines += ["", *errors] if errors else []
    for info in plugins:
        for warning in info.warnings:
            lines += wrap(f"warning: {warning}", width, hanging="    ")
    from attnhost.availability import check_availability

    with contextlib.suppress(PluginLoadError):  # a loaded plugin whose factory is not there is loaded, not well
        for entry in default_host().registry().entries():
            if (reason := check_availability(entry, "").reason or "").startswith("factory module"):
                lines += wrap(f"warning: backend {entry.name!r}: {reason}", width, hanging="    ")
    return lines


def _cmd_resolve(args: argparse.Namespace, width: int | None) -> list[str] | dict[str, Any]:
    from attnhost.availability import check_availability
    from attnhost.host import get_registry
    from attnhost.platform import current_platform
    from attnhost.resolution import resolve
    from attnhost.server_args import ServerArgs

    platform = current_platform(args.platform)
    # The text report lists every warning resolution raises; the log line would show each a second time.
    held: list[str] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record.getMessage())
        return False

    resolution_logger = logging.getLogger("attnhost.resolution")
    if not args.json:
        resolution_logger.addFilter(hold)
    try:
        result = resolve(ServerArgs.from_cli_args(args), platform)
    finally:
        resolution_logger.removeFilter(hold)
    registry = get_registry()
    chosen = {"prefill": result.target.prefill, "decode": result.target.decode, "draft": result.draft.name}
    availability = {role: check_availability(registry.entry(name), platform) for role, name in chosen.items()}
    if args.json:
        facts = {role: {"available": a.available, "reason": a.reason} for role, a in availability.items()}
        return {**result.to_json(), "availability": facts}
    rows = [["platform", platform, "(from --platform)" if args.platform else ""]]
    for role, name in chosen.items():
        notes = ["(fell back)"] if role == "draft" and result.draft.fell_back else []
        if not availability[role].available:
            notes.append(f"[not available here: {availability[role].reason}]")
        rows.append([role, name, " ".join(notes)])
    lines = [*fit_table(rows, width, flexible=(1,)), "", "trace:"]
    for number, step in enumerate(result.target.trace + result.draft.trace, 1):
        lines += wrap(step, width, indent=f"  {number}. ")
    warnings = list(dict.fromkeys([*result.warnings, *held]))
    lines += ["warnings:"] if warnings else []
    for warning in warnings:
        lines += wrap(warning, width, indent="  - ")
    return lines


_ENVIRONMENT = (
    (settings.PLUGINS_ENV, "comma-separated names: load only these third-party plugins (the built-ins always load)"),
    (settings.DISABLE_AUTOLOAD_ENV, "1: load only the built-in plugin"),
    (settings.STRICT_ENV, "1: a plugin that fails to load is an error (exit 1), not a warning"),
    (settings.PLATFORM_ENV, "cuda, rocm, xpu, npu, mps or cpu: the platform, instead of detecting it"),
    (settings.NO_CACHE_ENV, "1: neither read nor write the entry-point scan cache"),
    (settings.DEBUG_ENV, "1: show the traceback of an internal error"),
)

_FLAGS: dict[str, dict[str, Any]] = {
    "name": {"nargs": "?", "metavar": "NAME", "help": "show this backend (or alias) in full"},
    "--json": {"action": "store_true", "help": "machine-readable output"},
    "--draft": {"action": "store_true", "help": "only backends draft workers may use"},
    "--available": {"action": "store_true", "help": "only backends that can run here"},
    "--wide": {"action": "store_true", "help": "every column and the full text, however wide the terminal"},
    "--platform": {
        "metavar": "P",
        "help": "pretend to run on P (cuda, rocm, xpu, npu, mps, cpu) instead of detecting it; "
        "ATTNHOST_PLATFORM does the same",
    },
}

# name, handler, summary, description, flags
_COMMANDS = (
    (
        "list",
        _cmd_list,
        "every known attention backend, where it came from, and whether it runs here",
        "List every attention backend the installed plugins declare: its roles (target, draft), the plugin that "
        "registered it, and whether it can run on this platform. The table fits the terminal; reasons a backend "
        "cannot run are numbered notes below it. `attnhost list NAME` shows one backend in full.",
        "name --json --draft --available --wide --platform",
    ),
    (
        "plugins",
        _cmd_plugins,
        "every discovered plugin and its status",
        "List every plugin found in the entry-point group sglang.draft_attention_backends, its distribution, "
        "its status (loaded, failed, blocked, not-allowed, duplicate), the backends it added, and why it failed.",
        "--json --wide",
    ),
    (
        "versions",
        _cmd_versions,
        "torch and the engines installed here, against the versions attnhost is tested with",
        "Show the installed versions of torch, SGLang, vLLM and vLLM's CPU build (read from their metadata, "
        "nothing imported) next to the versions attnhost is tested with, and whether each is inside them.",
        "--json --wide",
    ),
    (
        "resolve",
        _cmd_resolve,
        "which backends target and draft would run, and why",
        "Resolve SGLang's attention flags as a server would: the target's prefill and decode backends and the "
        "speculative draft worker's, with every step of the decision and whether each result can run here.",
        "--json --wide --platform",
    ),
)


def _help(description: str, width: int, *, platform: bool = True) -> dict[str, Any]:
    """``--help``'s description and environment variables (ATTNHOST_PLATFORM where ``--platform`` is), wrapped."""
    epilog = ["environment variables:"]
    for name, text in _ENVIRONMENT:
        if platform or name != settings.PLATFORM_ENV:
            epilog += [f"  {name}", *wrap(text, width - 2, indent="      ")]
    return {
        "description": "\n".join(wrap(description, width - 2)),
        "epilog": "\n".join(epilog),
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }


def _build_parser(argv: Sequence[str], width: int) -> argparse.ArgumentParser:
    description = (
        "Inspect the attention backends attnhost discovers and resolves. With no command, runs `attnhost list` "
        "(with any flags given)."
    )
    parser = _Parser(prog="attnhost", **_help(description, width))
    parser.add_argument("--version", action="version", version=f"attnhost {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, handler, summary, text, flags in _COMMANDS:
        command = sub.add_parser(name, help=summary, **_help(text, width, platform="--platform" in flags))
        for flag in flags.split():
            command.add_argument(flag, **_FLAGS[flag])
        if name == "resolve" and "resolve" in argv:
            # Building the flags loads plugins (their backends are the choices); only pay for it when needed.
            from attnhost.server_args import ServerArgs

            ServerArgs.add_cli_args(command)
        command.set_defaults(handler=handler, parser=command)
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the CLI and return its exit status; meanwhile the ``attnhost`` logger writes only to ``err``."""
    is_program = argv is None
    if is_program:  # the process's own streams: in-process callers' streams are theirs
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):  # text the encoding cannot carry becomes escapes, not an error
                with contextlib.suppress(ValueError, OSError):
                    stream.reconfigure(errors="backslashreplace")
    argv = list(sys.argv[1:] if argv is None else argv)
    err = err or sys.stderr or io.StringIO()  # with stderr closed too, the messages go nowhere
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
    encoding = str(getattr(out, "encoding", None) or "utf-8")
    ENCODING.extend([] if encoding.lower().replace("-", "").replace("_", "") == "utf8" else [encoding])
    try:
        status = _run(argv, out, err, is_program)
        try:
            out.flush()  # now, so a full disk or a closed pipe is reported here, once, and not at interpreter exit
        except OSError as exc:
            status = _write_failed(exc, out, err, is_program)
    finally:
        del ENCODING[:]
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    return status


def _write_failed(exc: OSError, out: TextIO, err: TextIO, is_program: bool) -> int:
    if is_program and out is sys.stdout:
        # As Python's documentation recommends: stdout on /dev/null, so the flush at exit finds nothing to fail on
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
    if not isinstance(exc, BrokenPipeError):  # a reader that left (`attnhost list | head`) needs no message
        with contextlib.suppress(OSError, ValueError):
            err.write(f"attnhost: write error: cannot write the output: {exc.strerror or type(exc).__name__}\n")
    return EXIT_FAILURE


def _run(argv: list[str], out: TextIO, err: TextIO, is_program: bool) -> int:
    """Runs the command: every error becomes at most one line on ``err``, and an exit status."""

    def fail(message: str, status: int) -> int:
        err.write(bounded(printable(message.rstrip()), 2000) + "\n")
        return status

    debug = settings.env_flag(settings.DEBUG_ENV)
    try:
        width = terminal_width()
        parser = _build_parser(argv, width)
        if argv and not argv[0].startswith("-") and argv[0] not in (names := [c[0] for c in _COMMANDS]):
            import difflib  # a mistyped command gets the hint a mistyped backend name gets

            close = difflib.get_close_matches(argv[0], names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from: {', '.join(names)}"
            parser.error(f"unknown command {bounded(repr(argv[0]))}; {hint}")
        args, extra = parser.parse_known_args(argv)
        if args.command is None:  # `attnhost` / `python -m attnhost` alone: the common question
            args, extra = parser.parse_known_args(["list", *argv])  # with list's own flags: `attnhost --json`
        if extra:  # reported by the command's own parser, so the hint names `attnhost COMMAND --help`
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
        output = args.handler(args, None if args.wide else width)  # every command has --json and --wide
        if args.json:
            import json  # only the --json paths need it

            # ensure_ascii (the default) escapes control characters and non-ASCII text alike: always valid, any stdout
            output = [json.dumps(output, indent=2)]
        try:
            out.write("".join(line + "\n" for line in output))
        except OSError as exc:  # a write error (a full disk, a closed pipe); an OSError anywhere else is a bug
            return _write_failed(exc, out, err, is_program)
        from attnhost.host import get_registry

        get_registry()  # `plugins` reports a strict-mode failure before raising it (exit 1); the others already did
        return EXIT_OK
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, naming the plugin being loaded (PluginLoadInterrupted)
        return fail(f"attnhost: {str(exc) or 'interrupted'}", 130)
    except SystemExit as exc:  # --help / --version, or a usage error (its message)
        return int(exc.code or 0) if not isinstance(exc.code, str) else fail(exc.code, EXIT_USAGE)
    except (AttnhostError, ValueError) as exc:
        if debug and not isinstance(exc, (PluginLoadError, UnknownBackendError, PlatformError)):
            raise  # the user's own mistakes and a strict-mode failure are never a traceback
        return fail(f"attnhost: error: {exc}", EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE)
    except Exception as exc:
        if debug:
            raise
        return fail(
            f"attnhost: internal error: {type(exc).__name__}: {exc}; rerun with ATTNHOST_DEBUG=1 for the "
            "traceback and report it",
            EXIT_FAILURE,
        )
