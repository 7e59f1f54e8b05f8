"""The README's figures cannot drift from the benchmarks page (issue 49: a copy in the README had):
every number in its "What is measured" section is a number of ``docs/benchmarks.md``, where the
figures live with their commands and dates, and the section links there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a number as written: digits, optionally a decimal part ("1.71", "0.000", "2026"); not a piece of
# a longer one ("1.71" is not found in "11.71" nor in "1.715")
NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?![\d]|\.\d)")


def section(markdown: str, title: str) -> str:
    """The text under ``## title`` up to the next heading of the same level (or the end)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.S | re.M)
    assert match, f"no section '## {title}'"
    return match.group(1)


def numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


def figures_missing(readme_section: str, page: str) -> list[str]:
    """The numbers of the README's section that the page does not hold, in order of appearance."""
    on_page = numbers(page)
    return [n for n in dict.fromkeys(NUMBER.findall(readme_section)) if n not in on_page]


def test_every_readme_figure_is_on_the_benchmarks_page():
    measured = section((ROOT / "README.md").read_text(), "What is measured")
    assert "(docs/benchmarks.md)" in measured
    assert numbers(measured), "the section quotes its headline figures"
    assert figures_missing(measured, (ROOT / "docs" / "benchmarks.md").read_text()) == []


def test_a_drifted_figure_is_found():
    page = "async_speedup_vs_trl 1.71, 0.234 s a step (2026-12-06); 11.72 and 1.725 elsewhere"
    assert figures_missing("speedup 1.71 at 0.234 s/step, 2026-12-06", page) == []
    # a rounding of its own, a digit lost, a figure that is not on the page at all
    assert figures_missing("speedup 1.7, then 1.72 and 0.23 s, 3 seeds", page) == ["1.7", "1.72", "0.23", "3"]


def test_section_ends_at_the_next_heading():
    text = "## A\none 1\n### sub 2\n## B\nthree 3\n"
    assert numbers(section(text, "A")) == {"1", "2"}
    assert numbers(section(text, "B")) == {"3"}
