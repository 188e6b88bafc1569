"""The discovery cache: hits are real hits, and no change to the environment is ever missed.

All against real ``*.dist-info`` directories written by ``distgen``; nothing of
``os`` or ``importlib`` is mocked. "Was this a hit?" is observed through
``scan_stats()`` (counts of ``entry_points.txt`` files actually read) and, across
processes, by running ``scan()`` in fresh interpreters.

The racy window (see ``attnhost.entry_points``) is lowered to 50 ms here and the
fixture waits it out once, so the environment counts as settled; every change
below is then made *immediately* after a cached scan, well within the same
second, which is exactly the case mtime-in-seconds keys get wrong.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from distgen import make_dist, render_entry_points, settle

from attnhost import entry_points as E
from attnhost.entry_points import scan, scan_stats

G = "sglang.draft_attention_backends"
WINDOW_NS = 50_000_000


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
def site(tmp_path: Path, xdg: Path) -> list[str]:
    """A settled site directory with a few plugins, a non-plugin and a dist without entry points."""
    root = tmp_path / "site"
    make_dist(root, "plug-a", "1.0", {G: {"a": "plug_a:plugin"}})
    make_dist(root, "plug-b", "1.0", {G: {"b": "plug_b"}, "console_scripts": {"b": "plug_b:main"}})
    make_dist(root, "tool", "2.0", {"console_scripts": {"tool": "tool:main"}})
    make_dist(root, "bare", "3.0")
    settle(WINDOW_NS)
    return [str(root)]


def names(path: list[str]) -> list[tuple[str, str, str]]:
    return sorted((r.name, r.value, r.version) for r in scan(G, path=path))


def delta(before: dict[str, int]) -> dict[str, int]:
    after = scan_stats()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def cached_scan(path: list[str]) -> None:
    """Scan until the result is in the cache file (and the memo)."""
    scan(G, path=path)
    assert os.path.exists(E.cache_file(G, path)), scan_stats()


def assert_no_tmp_files(cache_home: Path) -> None:
    leftovers = [p.name for p in (cache_home / "attnhost").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


# --------------------------------------------------------------------------- hits


def test_cache_hit_returns_identical_records_without_parsing(site: list[str], xdg: Path) -> None:
    first = scan(G, path=site)
    assert scan_stats()["cache_writes"] == 1
    file = Path(E.cache_file(G, site))
    assert file.parent == xdg / "attnhost"

    E.clear_memo()
    before = scan_stats()
    second = scan(G, path=site)
    assert second == first
    assert delta(before) == {"scans": 1, "cache_hits": 1}  # no entry_points.txt or METADATA read

    before = scan_stats()
    third = scan(G, path=site)
    assert third == first
    assert delta(before) == {"scans": 1, "memo_hits": 1}
    assert [r.name for r in first] == sorted(r.name for r in first) or len(first) == 2
    assert {r.name for r in first} == {"a", "b"}
    assert_no_tmp_files(xdg)


def test_cache_hit_across_processes(site: list[str], xdg: Path) -> None:
    code = textwrap.dedent(
        f"""
        import json
        from attnhost import entry_points as E
        E.RACY_WINDOW_NS = {WINDOW_NS}  # as in this module: the site has settled for that long
        recs = E.scan({G!r}, path={site!r})
        print(json.dumps([[r.name, r.value, r.version, r.location] for r in recs]))
        print(json.dumps(E.scan_stats()))
        """
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(xdg))
    env.pop("ATTNHOST_NO_CACHE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(E.__file__).parents[1]), env.get("PYTHONPATH", "")])

    def run() -> tuple[str, str]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        records, stats = out.stdout.splitlines()
        return records, stats

    records1, stats1 = run()
    records2, stats2 = run()
    assert records1 == records2
    assert '"cache_misses": 1' in stats1 and '"cache_writes": 1' in stats1
    assert '"cache_hits": 1' in stats2 and '"entry_point_files_read": 0' in stats2, stats2


# --------------------------------------------------------------------------- changes right after a cached scan


@pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])
def test_install_is_seen_immediately(site: list[str], memo: bool) -> None:
    cached_scan(site)
    make_dist(Path(site[0]), "plug-new", "0.1", {G: {"new": "plug_new"}})
    if not memo:
        E.clear_memo()
    assert "new" in {r.name for r in scan(G, path=site)}


@pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])
def test_remove_is_seen_immediately(site: list[str], memo: bool) -> None:
    cached_scan(site)
    shutil.rmtree(Path(site[0]) / "plug_a-1.0.dist-info")
    if not memo:
        E.clear_memo()
    assert {r.name for r in scan(G, path=site)} == {"b"}


@pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])
def test_upgrade_is_seen_immediately(site: list[str], memo: bool) -> None:
    cached_scan(site)
    root = Path(site[0])
    new = root / "plug_a-2.0.dist-info"
    os.rename(root / "plug_a-1.0.dist-info", new)
    (new / "entry_points.txt").write_text(render_entry_points({G: {"a": "plug_a:plugin_v2", "a2": "plug_a:extra"}}))
    (new / "METADATA").write_text((new / "METADATA").read_text().replace("Version: 1.0", "Version: 2.0"))
    if not memo:
        E.clear_memo()
    assert [x for x in names(site) if x[0].startswith("a")] == [
        ("a", "plug_a:plugin_v2", "2.0"),
        ("a2", "plug_a:extra", "2.0"),
    ]


@pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])
def test_same_version_reinstall_with_new_entry_points_is_seen(site: list[str], memo: bool) -> None:
    """pip-style: the old metadata dir is removed and a new one with the same name written."""
    cached_scan(site)
    root = Path(site[0])
    shutil.rmtree(root / "plug_a-1.0.dist-info")
    make_dist(root, "plug-a", "1.0", {G: {"a": "plug_a:other"}})
    if not memo:
        E.clear_memo()
    assert ("a", "plug_a:other", "1.0") in names(site)


@pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])
def test_in_place_rewrite_same_size_and_restored_mtime_is_seen(site: list[str], memo: bool) -> None:
    """The hardest case: same inode, same size, mtime put back (cp -p / tar style). Only ctime moves."""
    cached_scan(site)
    ep = Path(site[0]) / "plug_a-1.0.dist-info" / "entry_points.txt"
    st = os.stat(ep)
    old = ep.read_bytes()
    new = old.replace(b"plug_a:plugin", b"plug_a:PLUGIN")
    assert len(new) == len(old)
    with open(ep, "r+b") as f:  # in place: same inode
        f.write(new)
    os.utime(ep, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(ep)
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    if not memo:
        E.clear_memo()
    assert ("a", "plug_a:PLUGIN", "1.0") in names(site)


def test_metadata_rewritten_in_place_is_seen(site: list[str]) -> None:
    """distribution/version come from METADATA, so its stat is part of the key."""
    cached_scan(site)
    meta = Path(site[0]) / "plug_a-1.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Name: plug-a", "Name: Plug.A"))
    E.clear_memo()
    assert {r.distribution for r in scan(G, path=site) if r.name == "a"} == {"Plug.A"}


def test_entry_points_file_added_to_existing_egg_info_is_seen(site: list[str]) -> None:
    """egg-info metadata is edited in place (setup.py develop), so each one keeps a stat in the key."""
    root = Path(site[0])
    make_dist(root, "legacy", "1.0", egg_info=True, mtime=time.time() - 3600)
    settle(WINDOW_NS)
    cached_scan(site)
    egg = next(root.glob("legacy-1.0*.egg-info"))
    (egg / "entry_points.txt").write_text(f"[{G}]\nlegacy = legacy_mod\n")
    E.clear_memo()
    assert "legacy" in {r.name for r in scan(G, path=site)}
    (egg / "entry_points.txt").write_text(f"[{G}]\nlegacy = legacy_mod:other\n")
    E.clear_memo()
    assert ("legacy", "legacy_mod:other", "1.0") in names(site)


@pytest.mark.parametrize("memo", [True, False], ids=["same-process", "fresh-process"])
def test_non_plugin_reinstalled_as_plugin_is_seen(site: list[str], memo: bool) -> None:
    """A .dist-info is replaced, never edited: an installer turning a non-plugin into one is seen at once."""
    cached_scan(site)
    root = Path(site[0])
    shutil.rmtree(root / "bare-3.0.dist-info")
    make_dist(root, "bare", "3.0", {G: {"bare": "bare_mod"}})
    if not memo:
        E.clear_memo()
    assert ("bare", "bare_mod", "3.0") in names(site)


def test_new_path_entry_and_shadowing_change_are_seen(site: list[str], tmp_path: Path) -> None:
    front = tmp_path / "front"
    path = [str(front), *site]
    cached_scan(path)  # 'front' does not exist yet
    make_dist(front, "plug-a", "9.0", {G: {"a_front": "front_mod"}})  # now shadows site's plug-a
    E.clear_memo()
    got = {r.name for r in scan(G, path=path)}
    assert "a_front" in got and "a" not in got


def test_fresh_environment_is_answered_but_not_cached(
    tmp_path: Path, xdg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the real 3 s window a just-written environment is parsed every time, never cached."""
    monkeypatch.setattr(E, "RACY_WINDOW_NS", 3_000_000_000)
    root = tmp_path / "fresh"
    make_dist(root, "fresh", "1.0", {G: {"fresh": "fresh_mod"}})
    before = scan_stats()
    assert [r.name for r in scan(G, path=[str(root)])] == ["fresh"]
    assert delta(before)["racy_skips"] == 1
    assert not os.path.exists(E.cache_file(G, [str(root)]))
    ep = root / "fresh-1.0.dist-info" / "entry_points.txt"
    ep.write_text(ep.read_text().replace("fresh_mod", "FRESH_MOD"))
    assert [r.value for r in scan(G, path=[str(root)])] == ["FRESH_MOD"]


# --------------------------------------------------------------------------- configuration


def test_xdg_cache_home_is_honoured_and_home_is_the_default(
    site: list[str], xdg: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached_scan(site)
    assert list((xdg / "attnhost").glob("entry-points-*.txt"))
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    E.clear_memo()
    scan(G, path=site)
    assert E.cache_dir() == str(tmp_path / "home" / ".cache" / "attnhost")
    assert list((tmp_path / "home" / ".cache" / "attnhost").glob("entry-points-*.txt"))


def test_groups_and_path_lists_get_their_own_files(site: list[str], tmp_path: Path) -> None:
    other = [*site, str(tmp_path / "elsewhere")]
    assert len({E.cache_file(G, site), E.cache_file("console_scripts", site), E.cache_file(G, other)}) == 3
    scan(G, path=site)
    scan("console_scripts", path=site)
    E.clear_memo()
    before = scan_stats()
    assert {r.name for r in scan("console_scripts", path=site)} == {"b", "tool"}
    assert delta(before) == {"scans": 1, "cache_hits": 1}


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_no_cache_env_writes_and_reads_nothing(
    site: list[str], xdg: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ATTNHOST_NO_CACHE", value)
    for _ in range(2):
        before = scan_stats()
        assert {r.name for r in scan(G, path=site)} == {"a", "b"}
        assert delta(before)["uncached"] == 1
    assert not xdg.exists()
    # use_cache=True overrides the environment variable ...
    scan(G, path=site, use_cache=True)
    assert os.path.exists(E.cache_file(G, site))


def test_use_cache_false_overrides_default(site: list[str], xdg: Path) -> None:
    scan(G, path=site, use_cache=False)
    assert not xdg.exists()


# --------------------------------------------------------------------------- broken caches


def _corruptions(good: bytes) -> dict[str, bytes]:
    text = good.decode()
    return {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "garbage": os.urandom(300),
        "invalid-utf8": b"\xff\xfe" + good,
        "wrong-schema": text.replace("cache\t1", "cache\t999", 1).encode(),
        "json": b'{"records": []}',
        "flipped-record": text.replace("plug_b", "plug_x").encode(),  # checksum catches it
        "wrong-digest": text.replace("K\t", "K\t0", 1).encode(),
    }


@pytest.mark.parametrize(
    "kind", ["empty", "truncated", "garbage", "invalid-utf8", "wrong-schema", "json", "flipped-record", "wrong-digest"]
)
def test_corrupt_cache_is_ignored_silently_and_rebuilt(
    site: list[str], xdg: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = scan(G, path=site)
    file = Path(E.cache_file(G, site))
    file.write_bytes(_corruptions(file.read_bytes())[kind])
    E.clear_memo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scan(G, path=site) == expected
    assert capsys.readouterr() == ("", "")
    E.clear_memo()
    before = scan_stats()
    assert scan(G, path=site) == expected
    assert delta(before) == {"scans": 1, "cache_hits": 1}  # it was rewritten


def test_cache_dir_that_is_a_file_is_ignored(site: list[str], xdg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xdg.mkdir()
    (xdg / "attnhost").write_text("I am a file")
    for _ in range(2):
        E.clear_memo()
        assert {r.name for r in scan(G, path=site)} == {"a", "b"}
    assert (xdg / "attnhost").read_text() == "I am a file"
    assert capsys.readouterr() == ("", "")


def test_cache_file_path_occupied_by_a_directory_is_ignored(site: list[str]) -> None:
    os.makedirs(E.cache_file(G, site))
    for _ in range(2):
        E.clear_memo()
        assert {r.name for r in scan(G, path=site)} == {"a", "b"}


def test_unwritable_cache_location_is_ignored(site: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc refuses new directories even for root: a genuinely unwritable cache home."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/self")
    for _ in range(2):
        E.clear_memo()
        assert {r.name for r in scan(G, path=site)} == {"a", "b"}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_cache_dir_is_ignored(site: list[str], xdg: Path) -> None:
    cached_scan(site)
    cache = xdg / "attnhost"
    os.remove(E.cache_file(G, site))
    cache.chmod(0o500)
    try:
        E.clear_memo()
        assert {r.name for r in scan(G, path=site)} == {"a", "b"}
        assert not os.path.exists(E.cache_file(G, site))
    finally:
        cache.chmod(0o700)


def test_concurrent_writers_leave_a_valid_cache(site: list[str], xdg: Path) -> None:
    code = f"from attnhost import entry_points as E; E.RACY_WINDOW_NS = {WINDOW_NS}; E.scan({G!r}, path={site!r})"
    env = dict(os.environ, XDG_CACHE_HOME=str(xdg))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(E.__file__).parents[1]), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(6)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert_no_tmp_files(xdg)
    E.clear_memo()
    before = scan_stats()
    assert {r.name for r in scan(G, path=site)} == {"a", "b"}
    assert delta(before) == {"scans": 1, "cache_hits": 1}


def test_key_stats_plugins_not_every_distribution(tmp_path: Path, xdg: Path) -> None:
    """A cache hit re-checks the path entry and the plugins' files, not all 300 distributions.

    Structural, not timed (the figures come from ``benchmarks/``): the stored
    plan lists what a hit must stat.
    """
    from distgen import make_environment

    root = tmp_path / "many"
    make_environment(root, 300, 30)
    settle(WINDOW_NS)
    path = [str(root)]
    assert len(scan(G, path=path)) == 30
    memo = E._MEMO[E._hash(E._identity(G, path))]
    plan = memo[1]
    ((_, names_, flags),) = plan.entries
    assert len(names_) == 300
    assert flags.count("1") == 30 and flags.count("-") == 270
    assert sum(len(t) for t in plan.targets()) == 30
