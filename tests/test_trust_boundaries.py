"""Trust boundaries, tried as an attacker and as a careless plugin author would, on real distributions.

Each plugin here is an installed distribution (``tests/distgen.py``) found
through its entry point, in this process (``sys.path``) or in a fresh
interpreter (the CLI). Module names are unique per test: this process keeps
every module it imported.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")  # the py312/py313 envs have no torch
from distgen import make_dist
from helpers import GROUP, make_plugin, run_cli, run_python, subprocess_env

import attnhost
from attnhost import (
    BackendSpec,
    BackendUnavailableError,
    ModelRunner,
    RegistryFrozenError,
    ServerArgs,
    resolve_attention_backends,
    resolve_draft_attention_backend,
)
from attnhost import discovery as discovery_module
from attnhost.host import _reset_for_tests, default_host
from attnhost.settings import parse_flag

TORCH_NATIVE = "attnhost_builtin.torch_native:TorchNativeAttnBackend"


def _plugin_source(backends: str, extra: str = "") -> str:
    return f"import attnhost\n{extra}\n@attnhost.hookimpl\ndef attnhost_attention_backends():\n    return {backends}\n"


# -- 1. isolation is enforced ------------------------------------------------------------------

SHARING_PLUGIN = '''
import attnhost
from attnhost_builtin.torch_native import TorchNativeAttnBackend

_ONE = None

def same_instance(runner):
    """A cached singleton: the very bug of SGLang #28559, handed to every runner."""
    global _ONE
    if _ONE is None:
        _ONE = TorchNativeAttnBackend(runner)
    return _ONE

def raises(runner):
    raise ValueError("no kernels for this GPU")

def exits(runner):
    raise SystemExit(3)

@attnhost.hookimpl
def attnhost_attention_backends():
    return [
        attnhost.BackendSpec(name="shared", factory=same_instance),
        attnhost.BackendSpec(name="shared_too", factory=same_instance),
        attnhost.BackendSpec(name="raising", factory=raises),
        attnhost.BackendSpec(name="exiting", factory=exits),
    ]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["shared"]
'''


@pytest.fixture
def sharing_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    module = f"sharing_plugin_{abs(hash(tmp_path.name))}"  # a fresh module (and singleton) per test
    make_plugin(site, "sharing-attn", "2.1", "sharing", module, SHARING_PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_a_factory_handing_one_instance_to_two_runners_is_refused(sharing_site: Path) -> None:
    args = ServerArgs(attention_backend="shared")
    target = ModelRunner(args, platform="cpu", num_layers=1)
    with pytest.raises(BackendUnavailableError) as caught:
        ModelRunner(args, is_draft=True, platform="cpu", num_layers=1)
    message = str(caught.value)
    assert "draft runner: attention backend 'shared'" in message
    assert "plugin 'sharing' (distribution sharing-attn 2.1)" in message
    assert "already returned for another runner" in message and "the target runs the draft's backend" in message
    # the target keeps its own backend: nothing of the refused runner leaked into it
    assert target.attn_backend.prefill_attention_backend_str == "shared"


def test_the_same_instance_twice_in_one_runner_is_refused(sharing_site: Path) -> None:
    # prefill 'shared' and decode 'shared_too' come from one factory that returns one object
    args = ServerArgs(prefill_attention_backend="shared", decode_attention_backend="shared_too")
    with pytest.raises(BackendUnavailableError, match=r"'shared_too' from plugin 'sharing'.*already returned"):
        ModelRunner(args, platform="cpu", num_layers=1)


@pytest.mark.parametrize(
    ("name", "cause"), [("raising", "ValueError: no kernels for this GPU"), ("exiting", "SystemExit: 3")]
)
def test_a_factory_exception_becomes_backend_unavailable_naming_plugin_distribution_backend(
    sharing_site: Path, name: str, cause: str
) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        ModelRunner(ServerArgs(attention_backend=name), platform="cpu", num_layers=1)
    message = str(caught.value)
    assert f"attention backend {name!r} from plugin 'sharing' (distribution sharing-attn 2.1)" in message
    assert f"its factory raised {cause}" in message and "fix or reinstall sharing-attn" in message
    assert "\n" not in message


# -- 2. the freeze is airtight ------------------------------------------------------------------


class _Late:
    def __init__(self, index: int) -> None:
        self.name = f"late_{index}"

    @attnhost.hookimpl
    def attnhost_attention_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=self.name)]


def _race_once() -> int:
    """The first ``ServerArgs`` (the freeze) against a thread registering plugins until it is refused."""
    _reset_for_tests()
    pm = attnhost.get_plugin_manager()  # plugins loaded: the race is register vs. freeze only
    start = threading.Barrier(2)
    frozen: list[object] = []
    refused: list[BaseException] = []

    def build_args() -> None:
        start.wait()
        ServerArgs()
        frozen.append(attnhost.get_registry())

    def register() -> None:
        start.wait()
        for index in range(100_000):
            try:
                pm.register(_Late(index), name=f"late_{index}")
            except RegistryFrozenError as exc:
                refused.append(exc)
                return

    threads = [threading.Thread(target=build_args), threading.Thread(target=register)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    registry = attnhost.get_registry()
    assert refused, "registering went on after the freeze"
    assert registry is frozen[0], "nothing rebuilt the registry after the freeze"
    registered = [name for name, _ in pm.list_name_plugin() if name.startswith("late_")]
    missing = [name for name in registered if name not in registry]
    assert not missing, f"registered but not in the frozen registry: {missing[:3]}"
    return len(registered)


def test_a_register_racing_the_first_server_args_never_changes_the_frozen_registry() -> None:
    for _ in range(20):
        _race_once()


def test_unregister_and_blocking_after_the_freeze_raise() -> None:
    pm = attnhost.get_plugin_manager()
    ServerArgs()
    for attempt in (
        lambda: pm.unregister(name="builtin"),
        lambda: pm.set_blocked("builtin"),
        lambda: pm.set_blocked("someone_else"),
        lambda: pm.unblock("someone_else"),
    ):
        with pytest.raises(RegistryFrozenError, match="after the first ServerArgs froze the backend registry"):
            attempt()
    assert pm.has_plugin("builtin") and "torch_native" in attnhost.get_registry()


def test_a_parser_snapshots_the_choices_so_a_later_registration_raises() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    with pytest.raises(RegistryFrozenError, match=r"ServerArgs\.add_cli_args\(parser\) froze"):
        attnhost.add_attention_backend_choices(["vendor_late"])
    assert "vendor_late" not in attnhost.get_registry()
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "vendor_late"])  # consistent: the name never existed


# -- 3. hooks are called as pluggy calls them --------------------------------------------------

ARGLESS_HOOKS = """
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return [attnhost.BackendSpec(name="argless_draft", factory="{factory}")]

@attnhost.hookimpl
def attnhost_draft_attention_backends():
    return ["argless_draft"]

@attnhost.hookimpl
def attnhost_draft_fallback():  # pluggy lets an implementation take a subset of the arguments: here, none
    return "argless_draft"

@attnhost.hookimpl
def attnhost_default_attention_backend():
    return "argless_draft"
"""


def test_an_implementation_taking_no_argument_is_asked_like_pluggy_asks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    site = tmp_path / "site"
    make_plugin(site, "argless-attn", "1.0", "argless", "argless_plugin_t3", ARGLESS_HOOKS.format(factory=TORCH_NATIVE))
    monkeypatch.syspath_prepend(str(site))
    draft = resolve_draft_attention_backend(ServerArgs(), "cuda")
    assert draft.name == "argless_draft" and "plugin 'argless'" in draft.trace[-1]
    target = resolve_attention_backends(ServerArgs(), "cuda")
    assert target.prefill == "argless_draft" and "plugin 'argless'" in target.trace[0]
    assert not [r for r in caplog.records if "TypeError" in r.getMessage()]
    pm = attnhost.get_plugin_manager()
    assert pm.hook.attnhost_draft_fallback(platform="cuda") == draft.name, "the same answer pluggy gives"


def test_a_wrapper_implementation_is_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = (
        "import attnhost\n@attnhost.hookimpl(wrapper=True)\ndef attnhost_draft_fallback(platform):\n"
        "    return (yield)\n"
    )
    site = tmp_path / "site"
    make_plugin(site, "wrapping-attn", "1.0", "wrapping", "wrapping_plugin_t3", source)
    monkeypatch.syspath_prepend(str(site))
    info = {p.name: p for p in default_host().plugins()}["wrapping"]
    assert info.status.value == "failed" and "attnhost_draft_fallback as a wrapper" in (info.error or "")


# -- 4. settings are read once, before any plugin code runs -------------------------------------

ENV_MEDDLER = """
import os
import attnhost
os.environ.pop("ATTNHOST_STRICT", None)
os.environ["ATTNHOST_PLATFORM"] = "rocm"

@attnhost.hookimpl
def attnhost_attention_backends():
    return []
"""


def test_a_plugin_changing_the_environment_at_import_changes_nothing(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "meddler-attn", "1.0", "meddler", "meddler_plugin", ENV_MEDDLER)
    make_plugin(site, "broken-attn", "1.0", "broken", "broken_plugin", "raise ImportError('broken on purpose')\n")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    strict = run_cli("list", "--json", path_entries=[site], env={**env, "ATTNHOST_STRICT": "1"})
    assert strict.returncode == 1 and "ATTNHOST_STRICT=1" in strict.stderr and "broken" in strict.stderr
    listed = run_cli("list", "--json", path_entries=[site], env=env)
    resolved = run_cli("resolve", "--json", path_entries=[site], env=env)
    assert listed.returncode == resolved.returncode == 0, listed.stderr + resolved.stderr
    platforms = {json.loads(listed.stdout)["platform"], json.loads(resolved.stdout)["platform"]}
    assert platforms == {"cpu"}, "list and resolve agree, and the plugin's ATTNHOST_PLATFORM=rocm came too late"


@pytest.mark.parametrize(
    ("raw", "value", "warns"),
    [
        (None, False, False),
        ("", False, False),
        ("1", True, False),
        (" TRUE ", True, False),
        ("yes", True, False),
        ("On", True, False),
        ("0", False, False),
        ("no", False, False),
        ("off", False, False),
        ("False", False, False),
        ("maybe", False, True),
        ("2", False, True),
        ("\x1b[2J", False, True),
    ],
)
def test_one_rule_for_booleans(raw: str | None, value: bool, warns: bool) -> None:
    parsed, warning = parse_flag("ATTNHOST_DEBUG", raw)
    assert parsed is value and (warning is not None) is warns
    if warning:
        assert warning.startswith("ATTNHOST_DEBUG=") and "not a boolean" in warning and "\x1b" not in warning


def test_an_unrecognised_boolean_is_one_warning_and_off(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "broken-attn", "1.0", "broken", "broken_plugin", "raise ImportError('broken on purpose')\n")
    result = run_cli("list", "--json", path_entries=[site], env={"ATTNHOST_STRICT": "maybe"})
    assert result.returncode == 0, "strict mode stays off"
    lines = [line for line in result.stderr.splitlines() if "ATTNHOST_STRICT" in line]
    assert len(lines) == 1 and "'maybe' is not a boolean" in lines[0]
    debug_no = run_cli("list", "--json", env={"ATTNHOST_DEBUG": "no"})
    assert debug_no.returncode == 0 and "ATTNHOST_DEBUG" not in debug_no.stderr


def test_an_empty_allow_list_is_an_allow_list_whatever_its_spelling(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "alpha-attn", "1.0", "alpha", "alpha_plugin", _plugin_source("[]"))
    statuses = []
    for value in ("", ",", " , ,"):
        result = run_cli("plugins", "--json", path_entries=[site], env={"ATTNHOST_PLUGINS": value})
        assert result.returncode == 0, result.stderr
        statuses.append({p["name"]: p["status"] for p in json.loads(result.stdout)["plugins"]})
    assert statuses[0] == statuses[1] == statuses[2] == {"builtin": "loaded", "alpha": "not-allowed"}
    unset = run_cli("plugins", "--json", path_entries=[site])
    assert {p["name"]: p["status"] for p in json.loads(unset.stdout)["plugins"]}["alpha"] == "loaded"


# -- 5. a hanging plugin import is named --------------------------------------------------------

HANGING = """
import hang_gate_t5
assert hang_gate_t5.released.wait(60), "the slow-import warning never came"
import attnhost

@attnhost.hookimpl
def attnhost_attention_backends():
    return []
"""


class _Collect(logging.Handler):
    def __init__(self, on_message: threading.Event) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.on_message = on_message

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if "still importing" in record.getMessage():
            self.on_message.set()


def test_a_slow_import_is_named_once_and_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    make_plugin(site, "hanging-attn", "0.3", "hanging", "hanging_plugin_t5", HANGING)
    (site / "hang_gate_t5.py").write_text("import threading\nreleased = threading.Event()\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(discovery_module, "SLOW_IMPORT_WARNING_S", 0.01)
    import hang_gate_t5  # type: ignore[import-not-found]

    # The plugin's import finishes only once the warning has been logged: no timing decides this test.
    handler = _Collect(hang_gate_t5.released)
    logger = logging.getLogger("attnhost")
    logger.addHandler(handler)
    try:
        plugins = {p.name: p for p in default_host().plugins()}
    finally:
        logger.removeHandler(handler)
    assert plugins["hanging"].status.value == "loaded", "the host kept waiting"
    slow = [m for m in handler.messages if "still importing" in m]
    assert len(slow) == 1
    assert "plugin 'hanging' (distribution hanging-attn 0.3)" in slow[0] and "hanging_plugin_t5" in slow[0]


INTERRUPTED = """
import os, signal, time
os.kill(os.getpid(), signal.SIGINT)  # the operator presses Ctrl-C while this plugin is imported
time.sleep(60)
"""


def test_ctrl_c_while_plugins_load_exits_130_with_one_line(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "sleepy-attn", "1.2", "sleepy", "sleepy_plugin", INTERRUPTED)
    # as from a terminal: a shell without job control starts background jobs with SIGINT ignored, and Python
    # then keeps it ignored (no KeyboardInterrupt at all), so the child gets the default disposition back
    result = subprocess.run(
        [sys.executable, "-m", "attnhost", "list"],
        capture_output=True,
        text=True,
        env=subprocess_env([site]),
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert result.returncode == 128 + signal.SIGINT
    assert result.stderr.splitlines() == [
        "attnhost: interrupted while importing plugin 'sleepy' (distribution sleepy-attn 1.2) "
        "(entry point 'sleepy_plugin')"
    ]


# -- 6. plugin text cannot hurt (warnings and errors; the tables are the CLI's) -----------------


def test_control_characters_from_plugins_reach_no_warning_or_error(tmp_path: Path) -> None:
    site = tmp_path / "site"
    evil = "\x1b[2J\x1b[H"
    # never imported (a duplicate): its metadata alone must not reach the terminal raw
    make_plugin(site, "aaa-attn", "1.0", "twin", "twin_a", _plugin_source("[]"))
    make_dist(site, "zzz-attn", "6.6", {GROUP: {"twin": "twin_z"}}, metadata_name=f"zzz{evil}", modules={"twin_z": ""})
    # imported, and fails with an escape sequence in its exception text
    make_plugin(site, "loud-attn", f"1{evil}", "loud", "loud_plugin", f"raise RuntimeError({evil!r} + 'boom')\n")
    result = run_cli("list", "--json", path_entries=[site], env={"ATTNHOST_PLUGINS": f"twin,loud,tw1n{evil}"})
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stderr
    assert (
        "zzz\\x1b[2J\\x1b[H" in result.stderr
        and "1\\x1b[2J" in result.stderr
        and "\\x1b[2J\\x1b[Hboom" in result.stderr
    )
    strict = run_cli("list", path_entries=[site], env={"ATTNHOST_STRICT": "1"})
    assert strict.returncode == 1 and "\x1b" not in strict.stderr and "zzz\\x1b" in strict.stderr


PRINTING = """
import attnhost
print("hello from the plugin's import")

@attnhost.hookimpl
def attnhost_attention_backends():
    print("hello from a hook")
    return []

@attnhost.hookimpl
def attnhost_draft_fallback(platform):
    print("hello from the fallback hook")
    return None
"""


def test_what_a_plugin_prints_goes_to_stderr_so_json_stays_json(tmp_path: Path) -> None:
    site = tmp_path / "site"
    make_plugin(site, "printing-attn", "1.0", "printing", "printing_plugin", PRINTING)
    for command in (["list", "--json"], ["plugins", "--json"], ["resolve", "--json"]):
        result = run_cli(*command, path_entries=[site])
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)
        assert "hello from the plugin's import" in result.stderr and "hello from a hook" in result.stderr
    assert "hello from the fallback hook" in result.stderr


def test_another_threads_output_stays_on_stdout_while_a_plugin_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from attnhost.hooks import plugin_output

    inside, done = threading.Event(), threading.Event()

    def plugin_code() -> None:
        with plugin_output():
            print("from the plugin")
            inside.set()
            done.wait(30)

    thread = threading.Thread(target=plugin_code)
    thread.start()
    inside.wait(30)
    print("from the application")
    done.set()
    thread.join(30)
    out, err = capsys.readouterr()
    assert out == "from the application\n" and err == "from the plugin\n"
    assert sys.stdout is not None and type(sys.stdout).__name__ != "_PluginStdout", "the real stdout is back"


# -- 7. duplicate plugin rows --------------------------------------------------------------------


def test_a_duplicate_row_shows_its_own_distribution_and_none_of_the_winners_backends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    make_plugin(
        site, "first-attn", "1.0", "dup", "dup_first_t7", _plugin_source('[attnhost.BackendSpec(name="dup_b")]')
    )
    make_plugin(site, "second-attn", "2.0", "dup", "dup_second_t7", _plugin_source("[]"))
    monkeypatch.syspath_prepend(str(site))

    def rows() -> dict[str | None, tuple[str, tuple[str, ...]]]:
        return {p.distribution: (p.status.value, p.backends) for p in default_host().plugins() if p.name == "dup"}

    assert rows() == {"first-attn": ("loaded", ("dup_b",)), "second-attn": ("duplicate", ())}
    attnhost.add_attention_backend_choices(["rebuilt_now"])  # an in-process registration: the registry is rebuilt
    assert "rebuilt_now" in attnhost.get_registry()
    assert rows() == {"first-attn": ("loaded", ("dup_b",)), "second-attn": ("duplicate", ())}


def test_a_duplicate_row_survives_the_winner_failing_in_its_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    failing = "import attnhost\n@attnhost.hookimpl\ndef attnhost_attention_backends():\n    raise OSError('x')\n"
    make_plugin(site, "first-attn", "1.0", "dup", "dup_first_t7b", failing)
    make_plugin(site, "second-attn", "2.0", "dup", "dup_second_t7b", _plugin_source("[]"))
    monkeypatch.syspath_prepend(str(site))
    for _ in range(2):  # before and after a rebuild
        rows = {p.distribution: p.status.value for p in default_host().plugins() if p.name == "dup"}
        assert rows == {"first-attn": "failed", "second-attn": "duplicate"}
        attnhost.add_attention_backend_choices(["rebuild_again"])


# -- 8. attnhost.resolve is always the function ---------------------------------------------------


def test_public_names_are_never_shadowed_by_submodules() -> None:
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(attnhost.__path__):
        if module.name not in ("__main__", "testing", "engines"):
            importlib.import_module(f"attnhost.{module.name}")
    from attnhost import ModelRunner  # noqa: F401 - the import that used to replace attnhost.resolve

    for name, module_name in attnhost._MODULE_OF.items():
        value = getattr(attnhost, name)
        assert value is getattr(sys.modules[module_name], name), name
        assert not isinstance(value, type(sys)), f"attnhost.{name} is a module"
    assert callable(attnhost.resolve) and attnhost.resolve.__module__ == "attnhost.resolution"


# -- 9. scale and input -----------------------------------------------------------------------------


def test_backend_names_have_a_maximum_length() -> None:
    BackendSpec(name="x" * 64)
    with pytest.raises(ValueError, match="65 characters, more than the 64 allowed"):
        BackendSpec(name="x" * 65)
    with pytest.raises(ValueError, match="more than the 64 allowed"):
        attnhost.add_attention_backend_choices(["y" * 10_000])


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.complex64, "int8"])
def test_the_runner_refuses_a_non_floating_dtype(dtype: object) -> None:
    with pytest.raises(ValueError, match="is not a floating-point dtype"):
        ModelRunner(ServerArgs(attention_backend="torch_native"), platform="cpu", dtype=dtype)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'float33' is not a torch dtype"):
        ModelRunner(ServerArgs(attention_backend="torch_native"), platform="cpu", dtype="float33")


@pytest.mark.parametrize(
    "kwargs", [{"max_requests": 0}, {"max_context_len": -1}, {"num_slots": 0}, {"num_heads": 0}, {"num_layers": 1.5}]
)
def test_size_errors_name_the_parameter_that_is_wrong(kwargs: dict[str, object]) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"ModelRunner: {name} must be a positive integer"):
        ModelRunner(ServerArgs(attention_backend="torch_native"), platform="cpu", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass num_slots"):
        ModelRunner(ServerArgs(attention_backend="torch_native"), platform="cpu", max_requests=1, max_context_len=3)


def test_an_empty_platform_is_an_error_like_any_unknown_one() -> None:
    for command in ("list", "resolve"):
        result = run_cli(command, "--platform", "")
        assert result.returncode == 2 and result.stderr.startswith("attnhost: error: unknown platform ''")
        assert len(result.stderr.splitlines()) == 1
    with pytest.raises(attnhost.PlatformError):
        resolve_draft_attention_backend(ServerArgs(), "")


def test_torchless_import_of_a_torch_name_says_to_install_torch_in_one_line() -> None:
    result = run_python(
        "import sys\nsys.modules['torch'] = None  # torch is not installed\nfrom attnhost import ModelRunner\n"
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: attnhost.ModelRunner needs torch, which is not installed")
    assert "pip install 'attnhost[torch]'" in last and "download.pytorch.org/whl/cpu" in last
    assert result.stderr.count("needs torch") == 1
