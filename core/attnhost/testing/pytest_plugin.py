"""The pytest plugin (entry point group ``pytest11``): ``pytest --attnhost-backend NAME``.

Installed with attnhost, so pytest loads it in every run of every project in
the environment; without the option it must cost nothing and change nothing.
That is why this module imports neither torch nor attnhost's plugin machinery:
the suite is only imported once pytest collects it, which happens only when
the option names a backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["OPTION", "SUITE_PATH"]

OPTION = "--attnhost-backend"
SUITE_PATH = Path(__file__).with_name("suite.py")
"""The module holding the suite class this option runs (``TestBackendConformance``)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnhost", "attnhost backend conformance")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME",
        dest="attnhost_backend",
        help="run attnhost's backend conformance suite against NAME (repeat, or separate names with commas); "
        "with no test paths given, only the suite runs",
    )


def backend_names(config: pytest.Config) -> list[str]:
    """The names given with ``--attnhost-backend``, in order, without duplicates."""
    raw: list[str] = config.getoption("attnhost_backend", default=None) or []
    names = [name.strip() for value in raw for name in value.split(",")]
    return list(dict.fromkeys(name for name in names if name))


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not backend_names(config):
        return
    suite = str(SUITE_PATH)
    if config.args_source is pytest.Config.ArgsSource.ARGS:
        # Paths given explicitly: run them *and* the suite.
        if suite not in config.args:
            config.args.append(suite)
    else:
        # No paths given: testpaths or the current directory would run the project's own tests;
        # `pytest --attnhost-backend X` means "run the kit", so run only the kit.
        config.args[:] = [suite]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if getattr(metafunc.cls, "attnhost_cli_suite", False):
        names = backend_names(metafunc.config)
        metafunc.parametrize("attnhost_backend_name", names, ids=names)
