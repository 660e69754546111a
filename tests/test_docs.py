"""The documentation a user reads: every relative link of README, BENCHMARKS, CHANGELOG, docs/ and bench/README points
to a file that exists (and, with #anchor, to a heading there); README stays a front door (under ~250 lines, install,
quickstart, tests, results with machine and date); nothing a user reads, nor the package's comments, speaks of the
sessions or issues the project was built in."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md",
             *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in md.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold commands, not links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor})")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links: {bad}"


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    for needle in ("bash scripts/quickstart.sh", "bash scripts/test.sh", "setup_env.sh --gpu", "vllm serve",
                   "--enable-bdlora", "bdlora train", "H200", "2026-", "BENCHMARKS.md"):
        assert needle in text, needle
    assert text.index("bash scripts/quickstart.sh") < text.index("## Why")  # the commands come first


HISTORY = re.compile(r"\b(session|sessions|thirty-\w+|twentieth|nineteenth)\b|\bissue (\d+|\")", re.I)


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_the_product_not_its_history(doc):
    hits = [line for line in doc.read_text().splitlines() if HISTORY.search(line)]
    assert not hits, f"{doc.relative_to(ROOT)}: {hits[:3]}"


def test_package_comments_speak_of_the_present():
    """Package code says why it is as it is; measurements with dates and their raw data live in bench/results."""
    pattern = re.compile(r"\bsession\b|\bissue \d+|\b20\d\d-\d\d-\d\d\b|bench/results/", re.I)
    hits = []
    for folder in ("bdlora", "train", "vllm_plugin"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:10])
