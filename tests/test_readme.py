"""The front page and the docs run as written (documentation that drifts is a bug): their code examples run, their
plugins pass the conformance kit, their links lead somewhere, and the two commands are what CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import unicodedata
from pathlib import Path

import pytest
from distgen import make_dist
from helpers import (
    README,
    ROOT,
    doc,
    flat,
    guide_block,
    kit_run_problems,
    plugin_guide,
    run_python,
    subprocess_env,
)

#: The kit skips only the cases of what a plugin the docs show does not declare (it says so), nothing else.
UNDECLARED = ("does not declare ",)


def _run_kit(tmp_path: Path, site: Path, *pytest_args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a fresh author's directory with ``site`` installed, as the docs tell the author to run it."""
    author = tmp_path / "author"
    author.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *pytest_args],
        capture_output=True,
        text=True,
        cwd=author,
        env=subprocess_env([site], {"XDG_CACHE_HOME": str(tmp_path / "cache")}),
        timeout=600,
    )


@pytest.mark.torch  # it runs model runners
def test_python_example_runs_and_dispatches_per_runner() -> None:
    block = re.search(r"In Python:\n\n```python\n(.*?)```", doc("cli.md"), re.S)
    assert block, "docs/cli.md lost its 'In Python:' example"
    code = block.group(1) + (
        "\nwith target.forward_context():\n"
        "    assert attnhost.dispatch_attention_backend(ForwardMode.DECODE) == 'torch_native'\n"
        "    assert attnhost.get_attn_backend() is target.attn_backend\n"
        "with draft.forward_context():\n"
        "    assert attnhost.get_attn_backend() is draft.attn_backend\n"
        "print('ok')\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.torch
def test_plugin_guide_builds_a_backend_that_passes_the_conformance_kit(tmp_path: Path) -> None:
    """The guide's pyproject, hooks, kernel and test file, installed as written, pass the whole kit."""
    guide = plugin_guide()
    project = tomllib.loads(guide_block(guide, "# pyproject.toml"))["project"]
    site = tmp_path / "site"
    make_dist(
        site,
        project["name"],
        project["version"],
        project["entry-points"],
        modules={
            "acme_attn": guide_block(guide, "# acme_attn/__init__.py"),
            "acme_attn.kernels": guide_block(guide, "# acme_attn/kernels.py"),
        },
    )
    tests = tmp_path / "author" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_conformance.py").write_text(guide_block(guide, "# tests/test_conformance.py"))
    proc = _run_kit(tmp_path, site, "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # drafts and every dtype run; only what the guide's backend does not declare (flat_heads, tree_mask, mla) skips
    assert kit_run_problems(proc.stdout, UNDECLARED) == [], proc.stdout
    assert "does not declare tree_mask" in proc.stdout and "is target-only" not in proc.stdout


@pytest.mark.torch
def test_the_front_pages_plugin_passes_the_conformance_kit(tmp_path: Path) -> None:
    """README's two-file plugin, installed as written, passes the kit with the one command the README gives."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## A plugin in two files") :].split("\n## ", 1)[0]
    project = tomllib.loads(guide_block(section, "# pyproject.toml"))["project"]
    (name,) = project["entry-points"]["sglang.draft_attention_backends"]
    command = re.search(r"`(pytest --attnhost-backend \S+)`", section)
    assert command and command.group(1) == f"pytest --attnhost-backend {name}", "README's kit command lost its name"
    site = tmp_path / "site"
    modules = {"acme_attn": guide_block(section, "# acme_attn.py")}
    make_dist(site, project["name"], project["version"], project["entry-points"], modules=modules)
    proc = _run_kit(tmp_path, site, *command.group(1).split()[1:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert kit_run_problems(proc.stdout, UNDECLARED) == [], proc.stdout[-6000:]
    assert "is target-only" not in proc.stdout  # the shorthand is target- and draft-capable, and the drafts ran


def test_plugin_guide_documents_every_field_a_backend_reads() -> None:
    guide = flat(plugin_guide())
    for name in (
        "req_pool_indices",
        "seq_lens_cpu",
        "prefix_lens",
        "extend_prefix_lens",
        "extend_seq_lens_cpu",
        "extend_start_loc_cpu",
        "out_cache_loc",
        "req_to_token",
        "k_buffer(layer_id)",
        "set_kv(layer_id, loc, k, v, k_scale=1.0, v_scale=1.0)",
        "`page_size`",
        "forward_batch.page_table",
        "kv_cache_dtypes",
        "page_sizes",
        "strided views",
        "layer.scaling",
        "layer.num_kv_heads",
        "save_kv_cache",
        "BackendCapabilities",
        "by default is `forward_extend`",
        "first result wins",
        "`None` lets the next one answer",
        "--index-url https://download.pytorch.org/whl/cpu",
        "attnhost[test]",
    ):
        assert name in guide, name
    for hook in ("attnhost_attention_backends", "attnhost_draft_attention_backends", "attnhost_draft_fallback"):
        assert f"`{hook}(" in guide, hook
    from attnhost.hooks import HOOK_NAMES

    assert all(f"`{hook}(" in guide for hook in HOOK_NAMES), "every hook has a row in the guide's table"


def test_the_two_commands_are_what_ci_runs() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Two commands") :].split("\n## ", 1)[0]
    blocks = [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]
    assert blocks[:2] == ["pip install . && attnhost list", "pip install tox && tox p"], blocks
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1].endswith("&& tox p"), ci  # no environment named: every env of env_list, docs included
    assert "docs" in re.search(r"^env_list\s*=\s*(.*)$", (ROOT / "tox.ini").read_text(), re.M).group(1).split(", ")


def _slugs(markdown: str) -> set[str]:
    """The anchors of ``markdown``'s headings as both the docs site (Python-Markdown's toc) and GitHub make them;
    a link must work in both, so only an anchor both agree on counts."""
    site, github = set(), set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M):
        text = heading.replace("`", "")
        ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
        site.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower()))
        github.add(re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-"))
    return site & github


def test_every_link_of_the_readme_leads_somewhere() -> None:
    """The docs site's build checks its own links (`tox -e docs`); the README is outside it, so it is checked here."""
    text = re.sub(r"```.*?```", "", README.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links), "the front page links to no docs page"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # an address outside the repository
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and anchor not in _slugs(target.read_text(encoding="utf-8")):
            broken.append(f"{link}: no heading makes the anchor #{anchor}")
    assert broken == [], broken


def test_the_readme_links_every_docs_page() -> None:
    text = README.read_text(encoding="utf-8")
    missing = [path.name for path in sorted((ROOT / "docs").glob("*.md")) if path.name != "index.md"]
    missing = [name for name in missing if f"](docs/{name})" not in text]
    assert missing == [], f"README.md's page table does not link {missing}"
