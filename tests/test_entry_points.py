"""``attnhost.entry_points.scan`` must answer exactly what ``importlib.metadata`` answers.

Every environment here is real: distributions are written to temporary
directories with ``distgen`` (plus a few hand-made oddities: egg-info files,
unzipped eggs, a zip on the path, upper-case suffixes) and both implementations
read the same files. ``importlib.metadata`` is the oracle; nothing is mocked.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import pickle
import random
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from distgen import make_dist

from attnhost import entry_points as E
from attnhost.entry_points import EntryPointRecord, normalize_name, scan

G = "sglang.draft_attention_backends"
PY_TAG = f"py{sys.version_info[0]}.{sys.version_info[1]}"

Row = tuple[str, str, str, str, str, str, tuple[str, ...]]


def _canonical(ep: md.EntryPoint) -> tuple[str, tuple[str, ...]]:
    """importlib's parsed view of a value: ``module[:attr]`` plus extras, or the raw value if unparsable."""
    try:
        module, attr, extras = ep.module, ep.attr, tuple(ep.extras)
    except AttributeError:  # the pattern did not match
        return ep.value, ()
    return (f"{module}:{attr}" if attr else module), extras


def _location(dist: md.Distribution) -> str:
    return os.path.normpath(str(dist.locate_file("")))


def reference(group: str, path: Sequence[str]) -> list[Row]:
    """``importlib.metadata.entry_points(group=...)`` with ``sys.path = path`` (its own caches cleared)."""
    importlib.invalidate_caches()
    saved = sys.path[:]
    sys.path[:] = list(path)
    try:
        eps = md.entry_points(group=group)
    finally:
        sys.path[:] = saved
    rows = []
    for ep in eps:
        value, extras = _canonical(ep)
        assert ep.dist is not None
        rows.append((ep.name, value, ep.group, ep.dist.name, ep.dist.version, _location(ep.dist), extras))
    return rows


def rows(records: Sequence[EntryPointRecord]) -> list[Row]:
    return [
        (
            r.name,
            r.value,
            r.group,
            r.distribution,
            r.version,
            os.path.normpath(r.location or "."),
            r.extras,
        )
        for r in records
    ]


@pytest.fixture
def fast_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A short racy window so a freshly written environment can be cached within the test."""
    monkeypatch.setattr(E, "RACY_WINDOW_NS", 50_000_000)
    E.clear_memo()
    yield
    E.clear_memo()


def assert_equivalent(group: str, path: Sequence[str]) -> list[Row]:
    """scan() uncached, cached (miss, then hit from the file) and importlib all agree, in order."""
    expected = reference(group, path)
    assert rows(scan(group, path=path, use_cache=False)) == expected
    E.clear_memo()
    assert rows(scan(group, path=path, use_cache=True)) == expected
    E.clear_memo()
    assert rows(scan(group, path=path, use_cache=True)) == expected
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
    # egg-info without a version in its name: Name/Version come from PKG-INFO
    _write(a / "nover.egg-info" / "PKG-INFO", "Metadata-Version: 1.0\nName: NoVer\nVersion: 0.9\n")
    _write(a / "nover.egg-info" / "entry_points.txt", f"[{G}]\nnover = nover_mod\n")
    # dist-info without a version in its name: Version from METADATA
    _write(a / "Plain.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: Plain\nVersion: 4.5\n\n")
    _write(a / "Plain.dist-info" / "entry_points.txt", f"[{G}]\nplain_ep = plain_pkg:x\n")
    # upper-case suffix: found by importlib's lower-cased lookup, named by METADATA
    _write(a / "Upper-1.0.DIST-INFO" / "METADATA", "Metadata-Version: 2.1\nName: upper-case\nVersion: 1.0\n\n")
    _write(a / "Upper-1.0.DIST-INFO" / "entry_points.txt", f"[{G}]\nupper = upper_mod\n")
    # a legacy egg-info *file* (no entry points) still shadows a later 'shadowfile'
    _write(a / f"shadowfile-1.0-{PY_TAG}.egg-info", "Metadata-Version: 1.0\nName: shadowfile\nVersion: 1.0\n")
    # entry_points.txt that is a directory: unreadable, contributes nothing
    (make_dist(a, "epdir", "1.0") / "entry_points.txt").mkdir()

    make_dist(b, "Shadowed_Pkg", "1.0", {G: {"old": "old_mod"}})  # shadowed by a's 'shadowed-pkg'
    make_dist(b, "shadowfile", "1.0", {G: {"sf": "sf_mod"}})  # shadowed by the egg-info file
    make_dist(b, "beta", "1.0", {G: {"beta": "beta_mod:make"}})
    make_dist(b, "dup", "1.0", {G: {"dup_one": "dup_mod:one"}})  # two versions on one entry:
    make_dist(b, "dup", "2.0", {G: {"dup_two": "dup_mod:two"}})  # importlib keeps the first listed

    # an unzipped egg directory as a path entry
    egg = tmp / f"thing-1.0-{PY_TAG}.egg"
    _write(egg / "EGG-INFO" / "PKG-INFO", "Metadata-Version: 1.0\nName: thing\nVersion: 1.0\n")
    _write(egg / "EGG-INFO" / "entry_points.txt", f"[{G}]\nthing = thing_mod:T\n")

    # a zip on the path (handed to importlib.metadata for just that entry)
    zpath = tmp / "dists.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("zipped-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped\nVersion: 1.0\n\n")
        zf.writestr("zipped-1.0.dist-info/entry_points.txt", f"[{G}]\nzipped = zipped_mod:z\n")
        zf.writestr("beta-9.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: beta\nVersion: 9.0\n\n")
        zf.writestr("beta-9.0.dist-info/entry_points.txt", f"[{G}]\nbeta_zip = nope:x\n")  # shadowed by b

    junk = tmp / "junk.txt"
    junk.write_text("not a zip\n")
    make_dist(cwd, "in-cwd", "1.0", {G: {"cwd": "cwd_mod"}})
    return [str(a), "", str(tmp / "missing"), str(b), str(egg), str(junk), str(zpath)]


def test_mixed_environment_matches_importlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_cache: None) -> None:
    path = build_mixed_environment(tmp_path)
    monkeypatch.chdir(tmp_path / "cwd")
    expected = assert_equivalent(G, path)
    names = [row[0] for row in expected]
    # The scenario really exercises what it claims to.
    assert {"alpha", "new", "spaced", "tabbed", "plain", "again", "legacy", "nover", "plain_ep", "upper"} <= set(names)
    assert {"thing", "zipped", "beta", "cwd", "crlf"} <= set(names)
    assert not {"old", "sf", "beta_zip", "notmatched", "orphan", "notours"} & set(names)
    assert len({"dup_one", "dup_two"} & set(names)) == 1  # whichever os.listdir lists first, like importlib
    assert names.count("dup") == 2
    spaced = next(r for r in scan(G, path=path, use_cache=False) if r.name == "spaced")
    assert (spaced.value, spaced.extras) == ("spaced_mod:attr.sub", ("extra1", "extra2"))
    by_name = {r.name: r for r in scan(G, path=path, use_cache=False)}
    assert (by_name["legacy"].distribution, by_name["legacy"].version) == ("legacy.egg", "3.0")
    assert by_name["new"].distribution == "shadowed-pkg"  # the Name header, not the escaped dir name
    assert (by_name["nover"].distribution, by_name["nover"].version) == ("NoVer", "0.9")
    assert by_name["alpha"].location == str(tmp_path / "a")
    assert by_name["cwd"].location == ""
    assert by_name["bad"].value == "not a valid value!"
    # Other groups too (console_scripts spans several dists here).
    assert_equivalent("console_scripts", path)
    assert_equivalent("no.such.group", path)


def test_default_path_is_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_dist(tmp_path, "via-sys-path", "1.0", {G: {"vsp": "vsp_mod"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert rows(scan(G, use_cache=False)) == reference(G, sys.path)
    assert any(r.name == "vsp" for r in scan(G))


def test_pathlike_entries_are_accepted(tmp_path: Path) -> None:
    make_dist(tmp_path, "p", "1.0", {G: {"p": "p_mod"}})
    (rec,) = scan(G, path=[tmp_path], use_cache=False)  # type: ignore[list-item]
    assert rec.location == str(tmp_path)


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


@pytest.mark.parametrize("seed", range(30))
def test_random_environments_match_importlib(tmp_path: Path, seed: int, fast_cache: None) -> None:
    path = _random_environment(random.Random(seed), tmp_path)
    assert_equivalent(G, path)
    assert_equivalent("console_scripts", path)


# --------------------------------------------------------------------------- deliberate differences


def test_semicolon_comments_and_lines_without_equals(tmp_path: Path) -> None:
    """The spec (configparser) treats ``;`` as a comment; importlib yields a bogus ``; ...`` entry point.

    A line without ``=`` makes importlib raise (TypeError) for the whole environment; we skip that line.
    """
    make_dist(tmp_path, "semi", "1.0", entry_points_text=f"[{G}]\n; note = not_an_ep\nreal = real_mod\n")
    assert [r.name for r in scan(G, path=[str(tmp_path)], use_cache=False)] == ["real"]
    assert "; note" in [row[0] for row in reference(G, [str(tmp_path)])]  # importlib's behaviour, for the record

    broken = tmp_path / "broken"
    make_dist(broken, "noeq", "1.0", entry_points_text=f"[{G}]\njust a line\nok = ok_mod\n")
    assert [r.name for r in scan(G, path=[str(broken)], use_cache=False)] == ["ok"]
    with pytest.raises(TypeError):  # Pair.parse cannot unpack the line
        reference(G, [str(broken)])


def test_undecodable_entry_points_file_is_skipped(tmp_path: Path) -> None:
    make_dist(tmp_path, "good", "1.0", {G: {"good": "good_mod"}})
    bad = make_dist(tmp_path, "bad", "1.0", {G: {"bad": "bad_mod"}})
    (bad / "entry_points.txt").write_bytes(b"[" + G.encode() + b"]\nbad = \xff\xfe\n")
    assert [r.name for r in scan(G, path=[str(tmp_path)], use_cache=False)] == ["good"]
    with pytest.raises(UnicodeDecodeError):
        reference(G, [str(tmp_path)])


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root reads mode-000 files")
def test_unreadable_entry_points_file_is_skipped(tmp_path: Path) -> None:
    make_dist(tmp_path, "good", "1.0", {G: {"good": "good_mod"}})
    bad = make_dist(tmp_path, "locked", "1.0", {G: {"locked": "locked_mod"}})
    (bad / "entry_points.txt").chmod(0)
    try:
        assert [r.name for r in scan(G, path=[str(tmp_path)], use_cache=False)] == ["good"]
    finally:
        (bad / "entry_points.txt").chmod(0o644)


# --------------------------------------------------------------------------- the record


def test_record_is_frozen_hashable_picklable() -> None:
    rec = EntryPointRecord("n", "m.sub:obj.attr", G, "dist", "1.0", "/x", ("e",))
    with pytest.raises(AttributeError):
        rec.name = "other"
    with pytest.raises(AttributeError):
        del rec.value
    same = EntryPointRecord(name="n", value="m.sub:obj.attr", group=G, distribution="dist", version="1.0",
                            location="/x", extras=("e",))  # fmt: skip
    assert rec == same and hash(rec) == hash(same) and len({rec, same}) == 1
    assert rec != EntryPointRecord("n", "m.sub:obj.attr", G, "dist", "1.1", "/x", ("e",))
    assert pickle.loads(pickle.dumps(rec)) == rec
    assert (rec.module(), rec.attr()) == ("m.sub", "obj.attr")
    assert EntryPointRecord("n", "pkg.mod", G, "d", "1", "/x").attr() == ""
    assert "m.sub:obj.attr" in repr(rec)
    assert rec.to_dict()["extras"] == ["e"]


def test_load_imports_module_and_walks_attributes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_dist(
        tmp_path,
        "loadme",
        "1.0",
        {G: {"obj": "loadme_pkg.sub:Outer.inner", "mod": "loadme_pkg.sub", "missing": "loadme_pkg.sub:nope"}},
        modules={
            "loadme_pkg": "",
            "loadme_pkg.sub": "class Outer:\n    inner = 42\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    recs = {r.name: r for r in scan(G, path=[str(tmp_path)], use_cache=False)}
    assert recs["obj"].load() == 42
    assert recs["mod"].load() is sys.modules["loadme_pkg.sub"]
    with pytest.raises(AttributeError):
        recs["missing"].load()
    with pytest.raises(ValueError, match="malformed"):
        EntryPointRecord("x", "not valid!", G, "d", "1", "/x").load()
    with pytest.raises(ModuleNotFoundError):
        EntryPointRecord("x", "attnhost_no_such_module_xyz:obj", G, "d", "1", "/x").load()


def test_scanning_and_loading_import_nothing_heavy(tmp_path: Path) -> None:
    """The point of the module: no importlib.metadata (nor email, zipfile, csv, pathlib, json, re...)."""
    make_dist(tmp_path, "light", "1.0", {G: {"light": "light_mod:VALUE"}}, modules={"light_mod": "VALUE = 7\n"})
    package_dir = Path(E.__file__).parent
    # A bare stand-in for the ``attnhost`` package, so only entry_points and the modules it
    # imports run: the real package __init__ imports typing/importlib for its lazy exports.
    code = textwrap.dedent(
        f"""
        import os  # loaded at start-up by any interpreter not run with -S
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        package = type(sys)("attnhost")
        package.__path__ = [{str(package_dir)!r}]
        sys.modules["attnhost"] = package
        before = set(sys.modules)
        import attnhost.entry_points as mod
        for use_cache in (False, True, True):
            recs = mod.scan({G!r}, path=[{str(tmp_path)!r}], use_cache=use_cache)
            assert [r.load() for r in recs] == [7], recs
        new = sorted(set(sys.modules) - before)
        print(" ".join(new))
        """
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, check=True)
    new = set(out.stdout.split())
    heavy = {"importlib.metadata", "email", "zipfile", "csv", "pathlib", "json", "dataclasses", "inspect", "re",
             "tempfile", "hashlib", "typing", "contextlib"}  # fmt: skip
    assert not new & heavy, new
    ours = {"attnhost.entry_points", "attnhost._ep_record", "attnhost._ep_scan", "attnhost._ep_cache"}
    assert new <= ours | {"light_mod", "_blake2", "marshal", "stat", "_stat", "time", "__future__"}, new
