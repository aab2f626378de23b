"""The README and docs/ are what a newcomer reads first: keep them short, linked, current and
free of history (that lives in git).

Each check is a function over a page's text, tested below on a bad page too, so a check that
stops finding anything fails here rather than passing in silence.
"""
import re
from pathlib import Path

import pytest

from bench import report

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 250

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
HISTORY = [
    (re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), "a date"),
    (re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE), "an issue number"),
    (re.compile(r"\bfix(es)?\s*#?\d+", re.IGNORECASE), "a fix number"),
]


def user_docs() -> list[Path]:
    return [README, REPO / "infra" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.+)$", FENCE.sub("", text), re.MULTILINE)}


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links of `text` (the page at `page`) whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        if not file_part:  # a heading of this page
            if anchor not in anchors(text):
                broken.append(f"{target}: no heading with the anchor #{anchor}")
            continue
        dest = (page.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    return broken


def history(text: str) -> list[str]:
    """Dates, issue and fix numbers in `text`, each with its line number."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"line {number}: {what} ({m[0]!r})" for pattern, what in HISTORY for m in pattern.finditer(line)]
    return found


def shell_lines(text: str) -> list[str]:
    """Every line inside the page's fenced code blocks, stripped."""
    return [line.strip() for block in FENCE.findall(text) for line in block.splitlines()]


# -- the pages ---------------------------------------------------------------------------------


def test_readme_shows_the_two_commands_as_commands():
    lines = shell_lines(README.read_text())
    for command in ("make demo", "make test"):
        assert any(line.startswith(command + " ") or line == command for line in lines), command
    assert "`make test-fast`" in README.read_text()


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines, more than {MAX_README_LINES}: move depth into docs/"


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert broken_links(page, page.read_text()) == []


@pytest.mark.parametrize("page", user_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_history_in_user_docs(page):
    assert history(page.read_text()) == [], f"{page.relative_to(REPO)}: history belongs in git"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    pages = [*sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "runbooks"]
    assert [str(p.relative_to(REPO)) for p in pages if p not in linked] == []


def test_benchmark_tables_are_what_the_results_say():
    page = report.PAGE.read_text()
    assert report.fill(page, report.render()) == page, "run `python bench/report.py` to update docs/benchmarks.md"


# -- the checks catch what they are for ----------------------------------------------------------


def test_broken_links_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    text = ("[ok](other.md) [ok](other.md#a-section) [web](https://example.org/x) [here](#top)\n"
            "# Top\n[gone](missing.md) [bad anchor](other.md#no-such-section) [bad here](#nowhere)\n"
            "```\n[in a code block](ignored.md)\n```\n")
    assert broken_links(page, text) == ["missing.md: no such file",
                                        "other.md#no-such-section: no heading with the anchor #no-such-section",
                                        "#nowhere: no heading with the anchor #nowhere"]


def test_history_finds_dates_issue_and_fix_numbers():
    text = "Measured 2026-11-22.\nSince issue 8 and Issue #12,\nafter fix 7 it is faster.\nA prefix 3 is fine."
    assert [f.split(":")[0] for f in history(text)] == ["line 1", "line 2", "line 2", "line 3"]


def test_the_two_commands_must_be_in_a_code_block():
    assert "make demo" not in shell_lines("Run make demo and make test.\n")
    assert "make demo   # run it" in shell_lines("```bash\nmake demo   # run it\n```\n")


def test_benchmark_tables_out_of_step_with_the_results_are_caught(tmp_path):
    page = report.PAGE.read_text()
    stale = page.replace("<!-- report:scaling -->\n", "<!-- report:scaling -->\n| stale | table |\n", 1)
    assert report.fill(stale, report.render()) != stale
    with pytest.raises(report.ReportError, match="no_such_section"):
        report.fill(page + "<!-- report:no_such_section -->\n<!-- /report:no_such_section -->\n", report.render())
    with pytest.raises(report.ReportError, match="seed_spread"):
        report.fill(page.replace("<!-- report:seed_spread -->", "").replace("<!-- /report:seed_spread -->", ""),
                    report.render())
