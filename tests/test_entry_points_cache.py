"""The entry-point cache: hits are real hits, no change is missed, and nothing an attacker writes is trusted.

All against real ``*.dist-info`` directories written by ``distgen``; nothing of
``os`` or ``importlib_metadata`` is mocked. "Was this a hit?" is observed through
``scan_stats()`` and, across processes, by running ``scan()`` in fresh interpreters.

The racy window (see ``attnhost.entry_points``) is lowered to 50 ms here and
the fixture waits it out once, so the environment counts as settled; every change
below is then made *immediately* after a cached scan, well within the same
second, which is exactly the case mtime-in-seconds keys get wrong.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import importlib_metadata
import pytest
from distgen import make_dist, render_entry_points, settle

from attnhost import entry_points as E
from attnhost.entry_points import scan, scan_stats

G = "sglang.draft_attention_backends"
WINDOW_NS = 50_000_000
STDLIB = [sysconfig.get_path("stdlib"), os.path.join(sysconfig.get_path("stdlib"), "lib-dynload")]
CORE = str(Path(E.__file__).parents[1])
SITE_PACKAGES = str(Path(importlib_metadata.__file__).parents[1])


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    cache_home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    monkeypatch.delenv("ATTNHOST_NO_CACHE", raising=False)
    monkeypatch.setattr(E, "RACY_WINDOW_NS", WINDOW_NS)
    E.clear_memo()
    E.reset_scan_stats()
    yield cache_home
    E.clear_memo()


@pytest.fixture
def site(tmp_path: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A settled site directory, alone on ``sys.path`` (with the standard library), with a few plugins."""
    root = tmp_path / "site"
    make_dist(root, "plug-a", "1.0", {G: {"a": "plug_a:plugin"}})
    make_dist(root, "plug-b", "1.0", {G: {"b": "plug_b"}, "console_scripts": {"b": "plug_b:main"}})
    make_dist(root, "tool", "2.0", {"console_scripts": {"tool": "tool:main"}})
    make_dist(root, "bare", "3.0")
    monkeypatch.setattr(sys, "path", [str(root), *STDLIB])
    settle(WINDOW_NS)
    return root


def names() -> list[tuple[str, str, str]]:
    return sorted((r.name, r.value, r.version) for r in scan(G))


def delta(before: dict[str, int]) -> dict[str, int]:
    after = scan_stats()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def cache_file(group: str) -> str | None:
    """The cache file scan() uses for *group* on the current sys.path (None: no cache)."""
    return E.cache_file(E.identity(group, sys.path))


def cache_path() -> Path:
    file = cache_file(G)
    assert file is not None
    return Path(file)


def cached_scan() -> None:
    """Scan until the answer is in the cache file (and the memo)."""
    scan(G)
    assert cache_path().exists(), scan_stats()


def fresh(memo: bool) -> None:
    if not memo:
        E.clear_memo()


# --------------------------------------------------------------------------- hits


def test_cache_hit_returns_identical_records_without_importlib(site: Path, xdg: Path) -> None:
    first = scan(G)
    assert scan_stats()["cache_writes"] == 1
    assert cache_path().parent == xdg / "attnhost"
    E.clear_memo()
    before = scan_stats()
    assert scan(G) == first
    assert delta(before) == {"scans": 1, "cache_hits": 1}
    before = scan_stats()
    assert scan(G) == first
    assert delta(before) == {"scans": 1, "memo_hits": 1}
    assert {r.name for r in first} == {"a", "b"}
    assert [p.name for p in (xdg / "attnhost").iterdir() if p.name.endswith(".tmp")] == []


def _child_code(body: str) -> str:
    return textwrap.dedent(
        f"""
        import json, sys
        sys.path[:] = [{CORE!r}, *sys.path]
        from attnhost import entry_points as E
        E.RACY_WINDOW_NS = {WINDOW_NS}
        sys.path[:] = SITE_PATH
        """
    ) + textwrap.dedent(body)


def _run_child(code: str, site: Path, xdg: Path, extra_env: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    env.update(XDG_CACHE_HOME=str(xdg), **(extra_env or {}))
    path = [str(site), *STDLIB, SITE_PACKAGES]
    code = code.replace("SITE_PATH", repr(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, cwd=site)
    assert out.returncode == 0, out.stderr
    return out.stdout


SCAN_AND_REPORT = """
recs = E.scan("sglang.draft_attention_backends")
print(json.dumps([[r.name, r.value, r.version, r.location] for r in recs]))
print(json.dumps(E.scan_stats()))
print("importlib_metadata" in sys.modules)
"""


def test_cache_hit_across_processes(site: Path, xdg: Path) -> None:
    code = _child_code(SCAN_AND_REPORT)
    records1, stats1, imported1 = _run_child(code, site, xdg).splitlines()
    records2, stats2, imported2 = _run_child(code, site, xdg).splitlines()
    assert records1 == records2
    assert json.loads(stats1)["cache_writes"] == 1 and imported1 == "True"
    assert json.loads(stats2)["cache_hits"] == 1 and imported2 == "False", stats2


# --------------------------------------------------------------------------- changes right after a cached scan

BOTH = pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])


@BOTH
def test_install_is_seen_immediately(site: Path, memo: bool) -> None:
    cached_scan()
    make_dist(site, "plug-new", "0.1", {G: {"new": "plug_new"}})
    fresh(memo)
    assert "new" in {r.name for r in scan(G)}


@BOTH
def test_remove_is_seen_immediately(site: Path, memo: bool) -> None:
    cached_scan()
    shutil.rmtree(site / "plug_a-1.0.dist-info")
    fresh(memo)
    assert {r.name for r in scan(G)} == {"b"}


@BOTH
def test_upgrade_is_seen_immediately(site: Path, memo: bool) -> None:
    cached_scan()
    new = site / "plug_a-2.0.dist-info"
    os.rename(site / "plug_a-1.0.dist-info", new)
    (new / "entry_points.txt").write_text(render_entry_points({G: {"a": "plug_a:plugin_v2", "a2": "plug_a:extra"}}))
    (new / "METADATA").write_text((new / "METADATA").read_text().replace("Version: 1.0", "Version: 2.0"))
    fresh(memo)
    assert [x for x in names() if x[0].startswith("a")] == [
        ("a", "plug_a:plugin_v2", "2.0"),
        ("a2", "plug_a:extra", "2.0"),
    ]


@BOTH
def test_same_version_reinstall_with_new_entry_points_is_seen(site: Path, memo: bool) -> None:
    cached_scan()
    shutil.rmtree(site / "plug_a-1.0.dist-info")
    make_dist(site, "plug-a", "1.0", {G: {"a": "plug_a:other"}})
    fresh(memo)
    assert ("a", "plug_a:other", "1.0") in names()


def _rewrite_in_place_keeping_size_and_mtime(file: Path, old: bytes, new: bytes) -> None:
    """What dpkg/rpm-style in-place upgrades can do at worst: same inode, same size, mtime put back."""
    st = os.stat(file)
    data = file.read_bytes()
    assert len(old) == len(new) and old in data
    with open(file, "r+b") as f:
        f.write(data.replace(old, new))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(file)
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


@BOTH
def test_in_place_edit_of_a_plugins_entry_points_is_seen(site: Path, memo: bool) -> None:
    cached_scan()
    ep = site / "plug_a-1.0.dist-info" / "entry_points.txt"
    _rewrite_in_place_keeping_size_and_mtime(ep, b"plug_a:plugin", b"plug_a:PLUGIN")
    fresh(memo)
    assert ("a", "plug_a:PLUGIN", "1.0") in names()


@BOTH
def test_in_place_edit_turning_a_non_plugin_into_a_plugin_is_seen(site: Path, memo: bool) -> None:
    """The stale case of old: a non-plugin's entry_points.txt edited in place (same inode, size and mtime)."""
    before = "[console_scripts]\nlate = late_mod:main\n"
    after = f"[{G}]\nlate = late_mod\n"
    before += "#" * (len(after) - len(before) + 8) + "\n"
    after += "#" * (len(before) - len(after) - 1) + "\n"
    ep = make_dist(site, "late", "1.0", entry_points_text=before) / "entry_points.txt"
    settle(WINDOW_NS)
    cached_scan()
    assert "late" not in {r.name for r in scan(G)}
    _rewrite_in_place_keeping_size_and_mtime(ep, before.encode(), after.encode())
    fresh(memo)
    assert ("late", "late_mod", "1.0") in names()


@BOTH
def test_entry_points_file_added_to_an_existing_dist_info_is_seen(site: Path, memo: bool) -> None:
    cached_scan()
    (site / "bare-3.0.dist-info" / "entry_points.txt").write_text(f"[{G}]\nbare = bare_mod\n")
    fresh(memo)
    assert ("bare", "bare_mod", "3.0") in names()


@BOTH
def test_entry_points_file_removed_from_an_existing_dist_info_is_seen(site: Path, memo: bool) -> None:
    cached_scan()
    (site / "plug_b-1.0.dist-info" / "entry_points.txt").unlink()
    fresh(memo)
    assert {r.name for r in scan(G)} == {"a"}


def test_metadata_rewritten_in_place_is_seen(site: Path) -> None:
    """distribution/version come from METADATA, so its stat is part of the key."""
    cached_scan()
    meta = site / "plug_a-1.0.dist-info" / "METADATA"
    _rewrite_in_place_keeping_size_and_mtime(meta, b"Name: plug-a", b"Name: Plug.A")
    E.clear_memo()
    assert {r.distribution for r in scan(G) if r.name == "a"} == {"Plug.A"}


def test_entry_points_file_added_to_existing_egg_info_is_seen(site: Path) -> None:
    make_dist(site, "legacy", "1.0", egg_info=True)
    settle(WINDOW_NS)
    cached_scan()
    egg = next(site.glob("legacy-1.0*.egg-info"))
    (egg / "entry_points.txt").write_text(f"[{G}]\nlegacy = legacy_mod\n")
    E.clear_memo()
    assert "legacy" in {r.name for r in scan(G)}


def test_new_path_entry_and_shadowing_change_are_seen(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    front = tmp_path / "front"
    monkeypatch.setattr(sys, "path", [str(front), *sys.path])
    cached_scan()  # 'front' does not exist yet
    make_dist(front, "plug-a", "9.0", {G: {"a_front": "front_mod"}})  # now shadows site's plug-a
    E.clear_memo()
    got = {r.name for r in scan(G)}
    assert "a_front" in got and "a" not in got


def test_fresh_environment_is_answered_but_not_cached(
    tmp_path: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the real 3 s window a just-written environment is read every time, never cached."""
    monkeypatch.setattr(E, "RACY_WINDOW_NS", 3_000_000_000)
    root = tmp_path / "fresh"
    make_dist(root, "fresh", "1.0", {G: {"fresh": "fresh_mod"}})
    monkeypatch.setattr(sys, "path", [str(root), *STDLIB])
    before = scan_stats()
    assert [r.name for r in scan(G)] == ["fresh"]
    assert delta(before)["racy_skips"] == 1
    assert not cache_path().exists()
    ep = root / "fresh-1.0.dist-info" / "entry_points.txt"
    ep.write_text(ep.read_text().replace("fresh_mod", "FRESH_MOD"))
    assert [r.value for r in scan(G)] == ["FRESH_MOD"]


def test_key_stats_every_distribution_and_its_entry_points_and_plugins_metadata(
    tmp_path: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Structural, not timed (figures come from ``benchmarks/``): what a hit must stat."""
    from distgen import make_environment

    root = tmp_path / "many"
    make_environment(root, 300, 30)
    monkeypatch.setattr(sys, "path", [str(root), *STDLIB])
    settle(WINDOW_NS)
    assert len(scan(G)) == 30
    decoded = E.decode(cache_path().read_text(), len(sys.path))
    assert decoded is not None
    targets = decoded[1][0]
    with_file = len(list(root.glob("*.dist-info/entry_points.txt")))
    assert 30 < with_file < 300  # the plugins and some console_scripts
    assert len([t for t in targets if t.endswith("/entry_points.txt")]) == with_file
    assert len([t for t in targets if "/" not in t]) == 300  # every metadata directory
    assert len([t for t in targets if t.endswith("/METADATA")]) == 30  # the plugins'
    assert len(targets) == 300 + with_file + 30


# --------------------------------------------------------------------------- configuration


def test_xdg_cache_home_is_honoured_and_home_is_the_default(
    site: Path, xdg: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached_scan()
    assert list((xdg / "attnhost").glob("entry-points-*.txt"))
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    E.clear_memo()
    scan(G)
    assert os.path.dirname(cache_file(G) or "") == str(tmp_path / "home" / ".cache" / "attnhost")
    assert list((tmp_path / "home" / ".cache" / "attnhost").glob("entry-points-*.txt"))


@pytest.mark.parametrize("home", [None, "", "relative/home"])
def test_no_home_and_no_xdg_cache_home_means_no_cache(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: str | None
) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME")
    if home is None:
        monkeypatch.delenv("HOME", raising=False)
    else:
        monkeypatch.setenv("HOME", home)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cache_file(G) is None
    for _ in range(2):
        E.clear_memo()
        assert {r.name for r in scan(G)} == {"a", "b"}
    assert list(work.iterdir()) == []  # no ./~/.cache, no ./relative/home
    assert scan_stats()["cache_writes"] == 0


def test_groups_and_path_lists_get_their_own_files(site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = cache_file(G)
    assert here != cache_file("console_scripts")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "elsewhere")])
    assert cache_file(G) != here


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_no_cache_env_writes_and_reads_nothing(
    site: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """The host reads ATTNHOST_NO_CACHE with its other settings and tells scan(); a direct caller decides."""
    from attnhost.host import _reset_for_tests, default_host

    monkeypatch.setenv("ATTNHOST_NO_CACHE", value)
    for _ in range(2):
        _reset_for_tests()  # a new process: the settings are read again
        before = scan_stats()
        default_host().plugin_manager()
        assert delta(before)["uncached"] == 1
    assert not xdg.exists()
    scan(G, use_cache=False)
    assert not xdg.exists()
    scan(G)  # the argument, not the environment variable, decides
    assert cache_path().exists()


# --------------------------------------------------------------------------- broken or hostile caches


def _corruptions(good: bytes) -> dict[str, bytes]:
    text = good.decode()
    return {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "garbage": os.urandom(300),
        "invalid-utf8": b"\xff\xfe" + good,
        "wrong-schema": text.replace("cache\t2", "cache\t999", 1).encode(),
        "flipped-record": text.replace("plug_b", "plug_x").encode(),  # checksum catches it
    }


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "invalid-utf8", "wrong-schema", "flipped-record"])
def test_corrupt_cache_is_ignored_with_one_debug_line_and_rebuilt(
    site: Path, kind: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = scan(G)
    file = cache_path()
    file.write_bytes(_corruptions(file.read_bytes())[kind])
    E.clear_memo()
    with caplog.at_level(logging.DEBUG, logger="attnhost"):
        assert scan(G) == expected
    assert len([r for r in caplog.records if "entry-point cache ignored" in r.getMessage()]) == 1
    assert capsys.readouterr() == ("", "")
    E.clear_memo()
    before = scan_stats()
    assert scan(G) == expected
    assert delta(before) == {"scans": 1, "cache_hits": 1}  # it was rewritten


def _forge(extra_rows: list[E.Row]) -> None:
    """Rewrite the cache file as an attacker with write access would: valid checksum, valid key, extra records."""
    file = cache_path()
    decoded = E.decode(file.read_text(), len(E._paths()))
    assert decoded is not None
    digest, plan, rows = decoded
    text = E.encode(digest, plan, [*rows, *extra_rows])
    assert text is not None
    file.write_text(text)
    os.chmod(file, 0o600)


@pytest.mark.parametrize(
    "forged",
    [
        ("evil", "evil_mod", "attnhost", "0.1.0", 0, "plug_a-1.0.dist-info"),  # real dir, not declared there
        ("builtin", "evil_mod", "attnhost", "0.1.0", 0, "plug_a-1.0.dist-info"),
        ("evil", "evil_mod", "x", "1", 0, "../outside.dist-info"),  # a declaring file outside the path entry
        ("evil", "evil_mod", "x", "1", 0, "bare-3.0.dist-info"),  # a dir whose entry_points.txt is not in the key
        ("b", "plug_b", "plug-b", "1.0", 0, "plug_b-1.0.dist-info/../plug_a-1.0.dist-info"),
    ],
    ids=["undeclared", "builtin-name", "outside", "unkeyed", "traversal"],
)
def test_a_forged_record_is_never_returned(
    site: Path, tmp_path: Path, forged: E.Row, caplog: pytest.LogCaptureFixture
) -> None:
    outside = tmp_path / "outside.dist-info"
    outside.mkdir()
    (outside / "entry_points.txt").write_text(f"[{G}]\nevil = evil_mod\n")
    expected = scan(G)
    _forge([forged])
    E.clear_memo()
    before = scan_stats()
    with caplog.at_level(logging.DEBUG, logger="attnhost"):
        assert scan(G) == expected
    assert delta(before)["rejected"] == 1 and delta(before)["cache_misses"] == 1
    assert [r.getMessage() for r in caplog.records if "does not declare" in r.getMessage()]


def test_a_forged_builtin_is_not_imported_even_with_autoload_disabled(site: Path, xdg: Path, tmp_path: Path) -> None:
    """The attack of old: a forged record claiming to be attnhost's ran code under ATTNHOST_DISABLE_PLUGIN_AUTOLOAD."""
    marker = tmp_path / "pwned"
    (site / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    settle(WINDOW_NS)
    cached_scan()
    _forge(
        [
            ("builtin", "evil_mod", "attnhost", "0.1.0", 0, "plug_a-1.0.dist-info"),
            ("evil", "evil_mod", "attnhost", "0.1.0", 0, "plug_a-1.0.dist-info"),
        ]
    )
    code = _child_code(
        """
        import contextlib
        from attnhost.discovery import GuardedPluginManager, load_entry_points
        from attnhost.settings import LoadSettings
        pm = GuardedPluginManager(lambda what: contextlib.nullcontext())
        plugins = load_entry_points(pm, E.scan("sglang.draft_attention_backends"), LoadSettings.from_env())
        print(json.dumps({p.name: p.status.value for p in plugins}))
        """
    )
    out = _run_child(code, site, xdg, {"ATTNHOST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": CORE})
    assert not marker.exists()
    assert "evil" not in json.loads(out.splitlines()[-1])


def _assert_ignored_once(caplog: pytest.LogCaptureFixture, expected: object) -> None:
    E.clear_memo()
    before = scan_stats()
    with caplog.at_level(logging.DEBUG, logger="attnhost"):
        assert scan(G) == expected
    lines = [r.getMessage() for r in caplog.records if "entry-point cache ignored" in r.getMessage()]
    assert len(lines) == 1, lines
    assert delta(before).get("cache_hits", 0) == 0 and delta(before)["cache_misses"] == 1


def test_a_fifo_in_place_of_the_cache_file_does_not_hang(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = scan(G)
    file = cache_path()
    file.unlink()
    os.mkfifo(file, 0o600)
    _assert_ignored_once(caplog, expected)  # a blocking open would never return: no writer
    assert stat.S_ISREG(os.lstat(file).st_mode)  # replaced by a good one (a rename: the FIFO itself is not opened)


@pytest.mark.parametrize("target", ["/dev/zero", "valid-copy"])
def test_a_symlinked_cache_file_is_not_followed(
    site: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    expected = scan(G)
    file = cache_path()
    if target == "valid-copy":
        copy = tmp_path / "copy.txt"
        shutil.copy(file, copy)
        os.chmod(copy, 0o600)
        target = str(copy)
    file.unlink()
    file.symlink_to(target)
    _assert_ignored_once(caplog, expected)


def test_a_cache_file_writable_by_others_is_ignored(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = scan(G)
    os.chmod(cache_path(), 0o666)
    _assert_ignored_once(caplog, expected)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown to another user")
def test_a_cache_file_owned_by_another_user_is_ignored(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = scan(G)
    os.chown(cache_path(), 65534, 65534)
    _assert_ignored_once(caplog, expected)


def test_a_cache_directory_writable_by_others_is_ignored(
    site: Path, xdg: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = scan(G)
    os.chmod(xdg / "attnhost", 0o777)
    _assert_ignored_once(caplog, expected)
    assert scan_stats()["cache_writes"] == 1  # and nothing was written there


def test_an_oversized_cache_file_is_ignored(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = scan(G)
    with open(cache_path(), "ab") as f:
        f.truncate(E.MAX_CACHE_BYTES + 1)
    _assert_ignored_once(caplog, expected)


def test_modes_are_0700_and_0600_whatever_the_umask(site: Path, xdg: Path) -> None:
    old = os.umask(0)
    try:
        scan(G)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(xdg / "attnhost").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache_path()).st_mode) == 0o600


def test_cache_dir_that_is_a_file_is_ignored(site: Path, xdg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xdg.mkdir()
    (xdg / "attnhost").write_text("I am a file")
    for _ in range(2):
        E.clear_memo()
        assert {r.name for r in scan(G)} == {"a", "b"}
    assert (xdg / "attnhost").read_text() == "I am a file"
    assert capsys.readouterr() == ("", "")


def test_unwritable_cache_location_is_ignored(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc refuses new directories even for root: a genuinely unwritable cache home."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/self")
    for _ in range(2):
        E.clear_memo()
        assert {r.name for r in scan(G)} == {"a", "b"}


def test_concurrent_writers_leave_a_valid_cache(site: Path, xdg: Path) -> None:
    code = _child_code('E.scan("sglang.draft_attention_backends")').replace(
        "SITE_PATH", repr([str(site), *STDLIB, SITE_PACKAGES])
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNHOST_")}
    env["XDG_CACHE_HOME"] = str(xdg)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=site) for _ in range(6)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert [p.name for p in (xdg / "attnhost").iterdir() if p.name.endswith(".tmp")] == []
    out = _run_child(_child_code(SCAN_AND_REPORT), site, xdg)
    assert json.loads(out.splitlines()[1])["cache_hits"] == 1


# ------------------------------------------- a hit answers what importlib_metadata would


def _rewrite(change: Callable[[E.Plan, list[E.Row]], tuple[E.Plan, list[E.Row]]]) -> None:
    """Rewrite the cache file as its owner could: any plan and rows, with the key recomputed for that plan."""
    file = cache_path()
    path = E._paths()
    _, plan, rows = E.decode(file.read_text(), len(path))
    plan, rows = change(plan, rows)
    text = E.encode(E.key(E.identity(G, path), path, plan)[0], plan, rows)
    assert text is not None
    file.write_text(text)
    os.chmod(file, 0o600)


def _assert_refused(expected: tuple[E.EntryPointRecord, ...]) -> None:
    E.clear_memo()
    before = scan_stats()
    assert scan(G) == expected == tuple(reference_records())
    assert delta(before).get("cache_hits", 0) == 0 and delta(before)["rejected"] == 1, delta(before)


def reference_records() -> list[E.EntryPointRecord]:
    """importlib_metadata's own answer, as records (the oracle every hit must equal)."""
    importlib_metadata.MetadataPathFinder.invalidate_caches()
    return [r for r in scan(G, use_cache=False)]


def _also(site: Path, name: str, version: str, eps: dict[str, str]) -> E.Row:
    """Another metadata directory declaring ``eps`` (settled, then cached honestly), and a row forged from it."""
    meta = make_dist(site, name, version, {G: eps})
    settle(WINDOW_NS)
    E.clear_memo()
    cached_scan()
    entry, value = next(iter(eps.items()))
    return (entry, value, name, version, 0, meta.name)


def test_a_row_from_a_bare_egg_info_directory_is_refused(site: Path) -> None:
    bare = site / "egg-info"  # importlib_metadata reads an `egg-info` directory only inside a `*.egg` path entry
    bare.mkdir()
    (bare / "entry_points.txt").write_text(f"[{G}]\nevil = evil_mod\n")
    (bare / "PKG-INFO").write_text("Metadata-Version: 1.0\nName: evil\nVersion: 1\n")
    settle(WINDOW_NS)
    cached_scan()
    expected = scan(G)
    assert "evil" not in [r.name for r in expected]
    _rewrite(lambda plan, rows: (plan, [*rows, ("evil", "evil_mod", "evil", "1", 0, "egg-info")]))
    _assert_refused(expected)


def test_a_row_from_the_second_same_named_dist_info_of_a_directory_is_refused(site: Path) -> None:
    old = _also(site, "plug-a", "0.5", {"a_old": "plug_a_old:plugin"})
    expected = scan(G)
    chosen = next(r for r in expected if r.distribution == "plug-a")  # the first in the directory's listing order
    forged = old if chosen.name == "a" else ("a", "plug_a:plugin", "plug-a", "1.0", 0, "plug_a-1.0.dist-info")
    _rewrite(lambda plan, rows: (plan, [*rows, forged]))
    _assert_refused(expected)


def test_a_row_of_a_distribution_shadowed_earlier_on_the_path_is_refused(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    early = tmp_path / "early"
    make_dist(early, "plug-a", "2.0", {G: {"a2": "plug_a2:plugin"}})
    monkeypatch.setattr(sys, "path", [str(early), *sys.path])
    settle(WINDOW_NS)
    E.clear_memo()
    cached_scan()
    expected = scan(G)
    assert "a" not in [r.name for r in expected] and "a2" in [r.name for r in expected]
    _rewrite(lambda plan, rows: (plan, [*rows, ("a", "plug_a:plugin", "plug-a", "1.0", 1, "plug_a-1.0.dist-info")]))
    _assert_refused(expected)


def test_a_row_with_another_distribution_is_refused(site: Path) -> None:
    cached_scan()
    expected = scan(G)
    _rewrite(lambda plan, rows: (plan, [(*row[:2], "attnhost", *row[3:]) for row in rows]))
    _assert_refused(expected)


def test_dropping_the_rows_is_refused(site: Path) -> None:
    cached_scan()
    expected = scan(G)
    _rewrite(lambda plan, rows: (plan, []))
    _assert_refused(expected)


def test_a_shortened_plan_is_refused(site: Path) -> None:
    cached_scan()
    expected = scan(G)

    def drop_b(plan: E.Plan, rows: list[E.Row]) -> tuple[E.Plan, list[E.Row]]:
        shorter = [tuple(name for name in names if not name.startswith("plug_b")) for names in plan]
        return shorter, [row for row in rows if row[0] != "b"]

    _rewrite(drop_b)
    _assert_refused(expected)
