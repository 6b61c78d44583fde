"""The documents a user reads: no citation of a tracker or of files outside the repository, and
every link within the repository leads somewhere (a file, and the heading its anchor names)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_help import CITATION

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    str(p.relative_to(ROOT))
    for p in [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
OUTSIDE = re.compile(r"\.\./|/work/|\bshared/")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.+)$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation gone, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # (not in code)
    return {anchor(h) for h in HEADING.findall(text)}


def test_the_anchor_of_a_heading() -> None:
    assert anchor("## Waiting for a turn (`max_wait_ms`, both doors)"[3:]) == (
        "waiting-for-a-turn-max_wait_ms-both-doors"
    )
    assert anchor("Differences from heptamini, for client authors") == (
        "differences-from-heptamini-for-client-authors"
    )


@pytest.mark.parametrize("name", DOCUMENTS)
def test_a_document_cites_no_tracker_and_nothing_outside_the_repository(name: str) -> None:
    text = (ROOT / name).read_text()
    assert not CITATION.search(text), CITATION.search(text)
    assert not OUTSIDE.search(text), OUTSIDE.search(text)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_every_link_within_the_repository_leads_somewhere(name: str) -> None:
    source = ROOT / name
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # (another site)
        path, _, fragment = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{name}: {target} leads nowhere"
        if fragment and linked.suffix == ".md":
            assert fragment in anchors(linked), f"{name}: {target}: no such heading"
