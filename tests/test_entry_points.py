"""``attnhost.entry_points.scan`` answers exactly what ``importlib_metadata.entry_points(group=...)`` answers.

Uncached, from a fresh cache miss, and from a cache hit: the same records in
the same order. Every environment is real: distributions written with
``distgen`` (plus hand-made oddities: egg-info files, unzipped eggs, a zip on
the path, upper-case suffixes) on a ``sys.path`` the test sets; nothing of
``importlib_metadata`` is mocked, it is the oracle.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import importlib_metadata as md
import pytest
from distgen import make_dist

from attnhost import entry_points as E
from attnhost.entry_points import EntryPointRecord, normalize_name, scan

G = "sglang.draft_attention_backends"
PY_TAG = f"py{sys.version_info[0]}.{sys.version_info[1]}"

Row = tuple[str, str, str, str, str, str]
OnPath = Callable[[Sequence[str]], None]
#: The standard library's own entries (no distributions there), kept so lazy imports keep working.
STDLIB = [sysconfig.get_path("stdlib"), os.path.join(sysconfig.get_path("stdlib"), "lib-dynload")]


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Sequence[str]], None]]:
    """Set ``sys.path`` to exactly the given entries for the rest of the test (modules already imported stay)."""

    def put(path: Sequence[str]) -> None:
        monkeypatch.setattr(sys, "path", [*path, *STDLIB])

    E.clear_memo()
    yield put
    E.clear_memo()


def _where(location: str) -> str:
    return os.path.normpath(location or ".")


def reference(group: str) -> list[Row]:
    """``importlib_metadata.entry_points(group=...)`` on the current ``sys.path``, its caches cleared.

    Whatever it answers is right by definition, quirks included (``; x`` is a name to it, a
    ``[[group]]`` header is the group, and this version finds nothing in the zip on the path).
    """
    md.MetadataPathFinder.invalidate_caches()
    rows = []
    for ep in md.entry_points(group=group):
        assert ep.dist is not None
        rows.append((ep.name, ep.value, ep.group, ep.dist.name, ep.dist.version, _where(str(ep.dist.locate_file("")))))
    return rows


def rows(records: Sequence[EntryPointRecord]) -> list[Row]:
    return [(r.name, r.value, r.group, r.distribution, r.version, _where(r.location)) for r in records]


@pytest.fixture
def fast_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short racy window so a freshly written environment can be cached within the test."""
    monkeypatch.setattr(E, "RACY_WINDOW_NS", 50_000_000)


def assert_equivalent(group: str) -> list[Row]:
    """scan() uncached, cached (miss, then hit from the file) and importlib_metadata all agree, in order."""
    import time

    expected = reference(group)
    assert rows(scan(group, use_cache=False)) == expected
    time.sleep(0.06)  # past the (lowered) racy window, so the miss below is written
    E.clear_memo()
    E.reset_scan_stats()
    assert rows(scan(group, use_cache=True)) == expected
    E.clear_memo()
    assert rows(scan(group, use_cache=True)) == expected
    return expected


ODD_ENTRY_POINTS = """\
# a comment before any section
orphan = before.any:section

[console_scripts]
cmd = commented_mod:main

  [sglang.draft_attention_backends]
   spaced   =   spaced_mod  :  attr.sub   [ extra1 , extra2 ]
\ttabbed\t=\ttabbed_mod:fn
# a comment inside the section
plain=plain_mod
dup = first_mod
dup = second_mod
weird.name-with.dots = dotted.mod:obj
eq = mod:attr=with=equals
bad = not a valid value!
; semicolon = is not a comment for importlib
[other]
notours = x:y
[[sglang.draft_attention_backends]]
again = again_mod:x
[ sglang.draft_attention_backends ]
notmatched = nm:x
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def build_mixed_environment(tmp: Path) -> list[str]:
    """Several path entries exercising shadowing, legacy layouts and broken entries."""
    a, b, cwd = tmp / "a", tmp / "b", tmp / "cwd"
    make_dist(a, "Alpha", "1.0", {G: {"alpha": "alpha_mod:Plugin"}, "console_scripts": {"alpha": "alpha_mod:main"}})
    make_dist(a, "shadowed-pkg", "2.0", {G: {"new": "new_mod"}})
    make_dist(a, "no-eps", "1.0")
    make_dist(a, "commented", "0.1", entry_points_text=ODD_ENTRY_POINTS)
    make_dist(a, "crlf", "1.0", entry_points_text=f"[{G}]\r\ncrlf = crlf_mod:obj\r\n\r\n[x]\r\ny = z\r\n")
    make_dist(a, "legacy.egg", "3.0", {G: {"legacy": "legacy_mod:obj.attr"}}, egg_info=True)
    make_dist(a, "empty-eps", "1.0", entry_points_text="")
    make_dist(a, "other-group-only", "1.0", {"pytest11": {"p": "p_mod"}})
    _write(a / "nover.egg-info" / "PKG-INFO", "Metadata-Version: 1.0\nName: NoVer\nVersion: 0.9\n")
    _write(a / "nover.egg-info" / "entry_points.txt", f"[{G}]\nnover = nover_mod\n")
    _write(a / "Plain.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: Plain\nVersion: 4.5\n\n")
    _write(a / "Plain.dist-info" / "entry_points.txt", f"[{G}]\nplain_ep = plain_pkg:x\n")
    _write(a / "Upper-1.0.DIST-INFO" / "METADATA", "Metadata-Version: 2.1\nName: upper-case\nVersion: 1.0\n\n")
    _write(a / "Upper-1.0.DIST-INFO" / "entry_points.txt", f"[{G}]\nupper = upper_mod\n")
    _write(a / f"shadowfile-1.0-{PY_TAG}.egg-info", "Metadata-Version: 1.0\nName: shadowfile\nVersion: 1.0\n")
    (make_dist(a, "epdir", "1.0") / "entry_points.txt").mkdir()

    make_dist(b, "Shadowed_Pkg", "1.0", {G: {"old": "old_mod"}})
    make_dist(b, "shadowfile", "1.0", {G: {"sf": "sf_mod"}})
    make_dist(b, "beta", "1.0", {G: {"beta": "beta_mod:make"}})
    make_dist(b, "dup", "1.0", {G: {"dup_one": "dup_mod:one"}})
    make_dist(b, "dup", "2.0", {G: {"dup_two": "dup_mod:two"}})

    egg = tmp / f"thing-1.0-{PY_TAG}.egg"
    _write(egg / "EGG-INFO" / "PKG-INFO", "Metadata-Version: 1.0\nName: thing\nVersion: 1.0\n")
    _write(egg / "EGG-INFO" / "entry_points.txt", f"[{G}]\nthing = thing_mod:T\n")

    zpath = tmp / "dists.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("zipped-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped\nVersion: 1.0\n\n")
        zf.writestr("zipped-1.0.dist-info/entry_points.txt", f"[{G}]\nzipped = zipped_mod:z\n")
        zf.writestr("beta-9.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: beta\nVersion: 9.0\n\n")
        zf.writestr("beta-9.0.dist-info/entry_points.txt", f"[{G}]\nbeta_zip = nope:x\n")

    junk = tmp / "junk.txt"
    junk.write_text("not a zip\n")
    make_dist(cwd, "in-cwd", "1.0", {G: {"cwd": "cwd_mod"}})
    return [str(a), "", str(tmp / "missing"), str(b), str(egg), str(junk), str(zpath)]


def test_mixed_environment_matches_importlib_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_path: OnPath, fast_cache: None
) -> None:
    path = build_mixed_environment(tmp_path)
    monkeypatch.chdir(tmp_path / "cwd")
    on_path(path)
    expected = assert_equivalent(G)
    names = [row[0] for row in expected]
    # The scenario really exercises what it claims to.
    assert {"alpha", "new", "spaced", "tabbed", "plain", "again", "legacy", "nover", "plain_ep", "upper"} <= set(names)
    assert {"thing", "beta", "cwd", "crlf", "bad", "; semicolon"} <= set(names)
    assert not {"old", "sf", "beta_zip", "notmatched", "orphan", "notours"} & set(names)
    by_name = {r.name: r for r in scan(G, use_cache=False)}
    assert by_name["spaced"].value == "spaced_mod  :  attr.sub   [ extra1 , extra2 ]"
    assert by_name["spaced"].parts == ("spaced_mod", "attr.sub", ("extra1", "extra2"))
    assert by_name["new"].distribution == "shadowed-pkg"  # the Name header, not the escaped dir name
    assert by_name["alpha"].location == str(tmp_path / "a")
    assert by_name["alpha"].source == str(tmp_path / "a" / "Alpha-1.0.dist-info")
    assert by_name["cwd"].location == ""
    assert_equivalent("console_scripts")
    assert_equivalent("no.such.group")


def test_answer_from_the_cache_equals_importlib_metadata(tmp_path: Path, on_path: OnPath, fast_cache: None) -> None:
    """Without a zip on the path the whole answer is cacheable, and the hit is the oracle's answer."""
    path = [build_mixed_environment(tmp_path)[0], str(tmp_path / "b")]
    on_path(path)
    expected = assert_equivalent(G)
    assert E.scan_stats()["cache_hits"] == 1, E.scan_stats()
    assert len(expected) > 10


POOL = ["foo", "Foo-Bar", "foo_bar", "FOO.bar", "baz", "qux-plugin", "Qux_Plugin", "zed"]


def _random_environment(rng: random.Random, tmp: Path) -> list[str]:
    roots = [tmp / f"e{i}" for i in range(3)]
    for root in roots:
        root.mkdir()
    for _ in range(rng.randint(5, 18)):
        name = rng.choice(POOL)
        version = f"{rng.randint(0, 3)}.{rng.randint(0, 9)}"
        root = rng.choice(roots)
        eps: dict[str, dict[str, str]] | None
        if rng.random() < 0.2:
            eps = None
        else:
            eps = {}
            for group in rng.sample([G, "console_scripts", "other.group"], rng.randint(1, 3)):
                eps[group] = {}
                for _ in range(rng.randint(1, 3)):
                    ep_name = f"{normalize_name(name)}_{rng.randint(0, 99)}"
                    eps[group][ep_name] = f"mod_{rng.randint(0, 9)}:obj{rng.choice(['', '.x'])}"
        make_dist(root, name, version, eps, egg_info=rng.random() < 0.25)
    return [str(r) for r in roots]


@pytest.mark.parametrize("seed", range(20))
def test_random_environments_match_importlib_metadata(
    tmp_path: Path, seed: int, on_path: OnPath, fast_cache: None
) -> None:
    on_path(_random_environment(random.Random(seed), tmp_path))
    assert_equivalent(G)
    assert_equivalent("console_scripts")


def test_an_unreadable_distribution_does_not_hide_the_others(
    tmp_path: Path, on_path: OnPath, caplog: pytest.LogCaptureFixture
) -> None:
    """importlib_metadata raises for the whole call on one non-UTF-8 entry_points.txt; we skip that one, warning."""
    make_dist(tmp_path, "good", "1.0", {G: {"good": "good_mod"}})
    bad = make_dist(tmp_path, "bad", "1.0", {G: {"bad": "bad_mod"}})
    (bad / "entry_points.txt").write_bytes(b"[" + G.encode() + b"]\nbad = \xff\xfe\n")
    on_path([str(tmp_path)])
    with pytest.raises(UnicodeDecodeError):
        reference(G)
    with caplog.at_level(logging.WARNING, logger="attnhost"):
        assert [r.name for r in scan(G, use_cache=False)] == ["good"]
    assert [
        r.getMessage() for r in caplog.records if "bad 1.0" in r.getMessage() and "UnicodeDecodeError" in r.getMessage()
    ]


# --------------------------------------------------------------------------- the record


def test_record_is_frozen_hashable_picklable() -> None:
    rec = EntryPointRecord("n", "m.sub:obj.attr [e]", G, "dist", "1.0", "/x", "/x/dist-1.0.dist-info")
    with pytest.raises(AttributeError):
        rec.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del rec.value
    same = EntryPointRecord(
        name="n",
        value="m.sub:obj.attr [e]",
        group=G,
        distribution="dist",
        version="1.0",
        location="/x",
        source="/x/dist-1.0.dist-info",
    )
    assert rec == same and hash(rec) == hash(same) and len({rec, same}) == 1
    assert rec != EntryPointRecord("n", "m.sub:obj.attr [e]", G, "dist", "1.1", "/x", "/x/dist-1.0.dist-info")
    assert pickle.loads(pickle.dumps(rec)) == rec
    assert rec.parts == ("m.sub", "obj.attr", ("e",))
    assert EntryPointRecord("n", "pkg.mod", G, "d", "1", "/x").parts == ("pkg.mod", "", ())
    assert "m.sub:obj.attr" in repr(rec)
    assert rec.source == "/x/dist-1.0.dist-info"


def test_record_parses_values_like_importlib_metadata() -> None:
    for value in ["a", "a.b:c", "a.b : c.d", "a:b [x, y]", "a [x]", "not valid!", "a:b:c", " a:b", "a:"]:
        ours = EntryPointRecord("n", value, G, "d", "1", "/x")
        theirs = md.EntryPoint("n", value, G)
        try:
            expected = (theirs.module, theirs.attr or "", tuple(theirs.extras))
        except (AttributeError, ValueError):  # importlib_metadata's pattern did not match
            expected = ("", "", ())
        assert ours.parts == expected, value


def test_load_imports_module_and_walks_attributes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_dist(
        tmp_path,
        "loadme",
        "1.0",
        {G: {"obj": "loadme_pkg.sub:Outer.inner", "mod": "loadme_pkg.sub", "missing": "loadme_pkg.sub:nope"}},
        modules={"loadme_pkg": "", "loadme_pkg.sub": "class Outer:\n    inner = 42\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    recs = {r.name: r for r in scan(G, use_cache=False) if r.location == str(tmp_path)}
    assert recs["obj"].load() == 42
    assert recs["mod"].load() is sys.modules["loadme_pkg.sub"]
    with pytest.raises(AttributeError):
        recs["missing"].load()
    with pytest.raises(ValueError, match="malformed"):
        EntryPointRecord("x", "not valid!", G, "d", "1", "/x").load()
    with pytest.raises(ModuleNotFoundError):
        EntryPointRecord("x", "attnhost_no_such_module_xyz:obj", G, "d", "1", "/x").load()


def test_a_cache_hit_imports_neither_importlib_metadata_nor_anything_heavy(tmp_path: Path) -> None:
    """The point of the cache: a hit runs on os/sys/stat/marshal/_blake2 alone."""
    site_dir = tmp_path / "site"
    make_dist(site_dir, "light", "1.0", {G: {"light": "light_mod:VALUE"}}, modules={"light_mod": "VALUE = 7\n"})
    package_dir = Path(E.__file__).parent
    site = str(Path(md.__file__).parents[1])  # where importlib_metadata is installed
    # A bare stand-in for the ``attnhost`` package, so only the entry-point module runs.
    code = textwrap.dedent(
        f"""
        import os, sys, time
        package = type(sys)("attnhost")
        package.__path__ = [{str(package_dir)!r}]
        sys.modules["attnhost"] = package
        sys.path[:] = [{str(site_dir)!r}, *sys.path, {site!r}]
        if sys.argv[1] == "hit":
            class Refuse:  # importing either library would fail loudly
                def find_spec(self, name, path=None, target=None):
                    if name.partition(".")[0] == "importlib_metadata" or name == "importlib.metadata":
                        raise ImportError(f"the cache hit imported {{name}}")
            sys.meta_path.insert(0, Refuse())
        before = set(sys.modules)
        import attnhost.entry_points as mod
        mod.RACY_WINDOW_NS = 0
        recs = mod.scan({G!r})
        assert "light" in [r.name for r in recs], recs
        new = sorted(set(sys.modules) - before)
        print(" ".join(new))
        print(mod.scan_stats()["cache_hits"])
        """
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("ATTNHOST_NO_CACHE", None)

    def run(mode: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-S", "-c", code, mode], capture_output=True, text=True, env=env, cwd=site_dir
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    run("prime")
    new_line, hits = run("hit")
    assert hits == "1"
    new = set(new_line.split())
    heavy = {
        "importlib.metadata",
        "importlib_metadata",
        "email",
        "zipfile",
        "csv",
        "pathlib",
        "json",
        "dataclasses",
        "inspect",
        "re",
        "tempfile",
        "hashlib",
        "typing",
        "contextlib",
        "logging",
    }
    assert not new & heavy, new
    assert new <= {"attnhost.entry_points", "_blake2", "marshal", "stat", "_stat", "time", "__future__"}, new
