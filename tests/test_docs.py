"""The docs stay true to the code: the generated state diagram and table match the
`transitions` machine, the examples run and move the right bytes, the doctest blocks in
the pages pass, the pages only name tests that exist, and the site builds strictly."""

from __future__ import annotations

import doctest
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xavier_async import diagram
from xavier_async.policy import (DEFAULT_STREAK, EVENTS, LARGE_BATCH, SMALL_BATCH, build_machine,
                                 state_names, state_view, transition_table)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = ROOT / diagram.SNIPPET_DIR

# `src --> dest : event / view view`
EDGE = re.compile(r"^\s*(\w+)\s*-->\s*(\w+)\s*:\s*(\w+)\s*/\s*(\w+) view\s*$")
INITIAL = re.compile(r"^\s*\[\*\]\s*-->\s*(\w+)\s*$")


def parse_edges(mermaid: str) -> tuple[str | None, dict[tuple[str, str], str], dict[tuple[str, str], str]]:
    """(initial state, {(src, event): dest}, {(src, event): view label}) from a diagram."""
    initial = None
    edges: dict[tuple[str, str], str] = {}
    views: dict[tuple[str, str], str] = {}
    for line in mermaid.splitlines():
        m = INITIAL.match(line)
        if m:
            initial = m.group(1)
            continue
        m = EDGE.match(line)
        if m:
            src, dest, event, view = m.groups()
            assert (src, event) not in edges, f"duplicate edge {src} on {event}"
            edges[(src, event)] = dest
            views[(src, event)] = view
    return initial, edges, views


def committed_diagram() -> str:
    text = (SNIPPETS / diagram.DIAGRAM_FILE).read_text(encoding="utf-8")
    m = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert m, "the committed diagram has no mermaid fence"
    return m.group(1)


# -- the generated diagram and table ------------------------------------------------------
def test_committed_files_match_the_machine():
    """Fails when the machine changed and `python -m xavier_async.diagram` was not rerun."""
    for name, content in diagram.expected_files(DEFAULT_STREAK).items():
        path = SNIPPETS / name
        assert path.exists(), f"{path} missing: run `python -m xavier_async.diagram`"
        assert path.read_text(encoding="utf-8") == content, (
            f"{path} differs from the machine: run `python -m xavier_async.diagram` and commit")


def test_committed_diagram_is_the_generated_one():
    assert committed_diagram() == diagram.state_diagram(DEFAULT_STREAK)


@pytest.mark.parametrize("streak", [1, 2, 3, 5])
def test_diagram_edges_equal_transition_table(streak):
    initial, edges, views = parse_edges(diagram.state_diagram(streak))
    assert initial == build_machine(streak).initial == "full"
    assert edges == {(s, e): d for (s, e), d in transition_table(streak).items()}
    assert {s for s, _ in edges} == set(state_names(streak))
    for (src, event), view in views.items():
        assert view == state_view(edges[(src, event)]), "edge label must name the view after the event"


def test_committed_diagram_edges_equal_transition_table():
    initial, edges, _ = parse_edges(committed_diagram())
    assert initial == "full"
    assert edges == dict(transition_table(DEFAULT_STREAK))
    assert len(edges) == len(state_names(DEFAULT_STREAK)) * len(EVENTS)


def test_generated_table_rows_follow_the_machine():
    table = diagram.state_table(DEFAULT_STREAK)
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `(\w+)`", r).group(1) for r in rows] == state_names(DEFAULT_STREAK)
    for row in rows:
        src = re.match(r"\| `(\w+)`", row).group(1)
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        for event, cell in zip(EVENTS, cells):
            dest = transition_table(DEFAULT_STREAK)[(src, event)]
            assert f"`{dest}`" in cell
            assert ("small view" if state_view(dest) == "small" else "full slab") in cell


def test_hand_written_table_on_the_state_machine_page_matches_the_machine():
    """The BRIEF's table, as written on docs/state-machine.md, agrees with the machine."""
    page = (DOCS / "state-machine.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (full|streak_1|small) \| -> (\w+), ([^|]+)\| -> (\w+), ([^|]+)\|$",
                      page, re.M)
    assert len(rows) == 3
    table = transition_table(2)
    for src, small_dest, small_view, large_dest, large_view in rows:
        assert table[(src, SMALL_BATCH)] == small_dest
        assert table[(src, LARGE_BATCH)] == large_dest
        assert ("small view" in small_view) == (state_view(small_dest) == "small")
        assert "full slab" in large_view


def test_check_mode_fails_on_a_stale_file_and_passes_after_writing(tmp_path, capsys):
    assert diagram.main(["--check", "--dir", str(tmp_path)]) == 1      # nothing there yet
    assert diagram.main(["--dir", str(tmp_path)]) == 0                 # write
    assert diagram.main(["--check", "--dir", str(tmp_path)]) == 0
    path = tmp_path / diagram.DIAGRAM_FILE
    path.write_text(path.read_text().replace("small_batch / small view", "small_batch / full view", 1))
    assert diagram.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().err
    assert diagram.main(["--check", "--dir", str(tmp_path), "--streak", "3"]) == 1


def test_check_mode_from_the_command_line_passes_on_the_committed_files():
    proc = subprocess.run([sys.executable, "-m", "xavier_async.diagram", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_print_mode(capsys):
    assert diagram.main(["--print", "--streak", "3"]) == 0
    out = capsys.readouterr().out
    assert out == diagram.state_diagram(3)
    assert "streak_2 --> small : small_batch / small view" in out


# -- the examples and the code on the pages -----------------------------------------------
def run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_two_endpoints_example_runs_and_checks_bytes():
    # the example asserts torch.equal on every layer; a failure exits non-zero
    out = run_example("two_endpoints.py")
    assert out.strip() == "loaded 4 blocks in 1 batch(es): 32768 useful B, 1048576 B on the wire"


def test_two_endpoints_example_output_is_the_one_on_the_index_page():
    page = (DOCS / "index.md").read_text(encoding="utf-8")
    assert '--8<-- "examples/two_endpoints.py"' in page
    assert run_example("two_endpoints.py").strip() in page


def test_sync_worker_example_runs_and_checks_bytes():
    out = run_example("sync_worker.py")
    assert out.strip() == "sync worker loaded 8 blocks (32768 B)"


def pages_with_pycon() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if "```pycon" in p.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", pages_with_pycon())
def test_pycon_blocks_on_the_pages_pass(page):
    """Every ```pycon block on a page runs as a doctest; blocks of one page share names."""
    text = (DOCS / page).read_text(encoding="utf-8")
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    globs: dict[str, object] = {}
    blocks = list(re.finditer(r"```pycon\n(.*?)```", text, re.S))
    assert blocks
    for m in blocks:
        line = text[: m.start()].count("\n") + 1
        test = parser.get_doctest(m.group(1), globs, f"{page}:{line}", page, line)
        result = runner.run(test, out=lambda s: print(s, end=""), clear_globs=False)
        assert result.failed == 0, f"{page}:{line}"
        globs.update(test.globs)  # DocTest copies its globals


def test_pages_name_only_tests_and_files_that_exist():
    """Every `tests/...py` / `examples/...py` (and `::test_name`) named on a page exists."""
    missing = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for ref, name in sorted(set(re.findall(r"((?:tests|examples)/[\w/]+\.py)(?:::(\w+))?", text))):
            path = ROOT / ref
            if not path.exists():
                missing.append(f"{page.name}: {ref}")
            elif name and not re.search(rf"^(async )?def {name}\(", path.read_text(encoding="utf-8"), re.M):
                missing.append(f"{page.name}: {ref}::{name}")
    assert not missing, missing


def test_mermaid_blocks_avoid_statement_separators():
    """`;` ends a Mermaid statement: inside a label it silently breaks the diagram (the page
    then shows the source). A cheap early check; tests/test_docs_browser.py draws them."""
    bad = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"```mermaid\n(.*?)```", text, re.S):
            for i, line in enumerate(m.group(1).splitlines()):
                if ";" in line and not line.strip().startswith("%%"):
                    bad.append(f"{page.relative_to(DOCS)}: {line.strip()}")
    assert not bad, bad


# -- the site -------------------------------------------------------------------------------
def test_vendored_mermaid_is_the_pinned_release_with_its_licence():
    """The site draws its diagrams with the committed Mermaid (no CDN): it is byte for byte
    the pinned npm release (docs/vendor_mermaid.py), with its MIT licence beside it, and
    mkdocs.yml loads it."""
    spec = importlib.util.spec_from_file_location("vendor_mermaid", DOCS / "vendor_mermaid.py")
    assert spec is not None and spec.loader is not None
    vendor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vendor)
    assert vendor.check() == []
    assert "assets/mermaid/mermaid.min.js" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_mkdocs_build_strict(tmp_path):
    for mod in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(mod.split(".")[0]) is None or (
                "." in mod and importlib.util.find_spec(mod) is None):
            pytest.skip(f"{mod} not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (site / "state-machine" / "index.html").read_text(encoding="utf-8")
    # the diagram reaches the page as a Mermaid block (superfences custom fence), not as code
    assert '<pre class="mermaid"><code>' in page or '<div class="mermaid">' in page
    assert "small_batch / small view" in page
    assert '<script src="../assets/mermaid/mermaid.min.js"' in page  # the local renderer
    assert (site / "api" / "index.html").read_text(encoding="utf-8").count("doc-heading") > 10
