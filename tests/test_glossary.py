"""docs/glossary.md stays honest: each coined word is defined once, every definition is linked
from a page that uses the word, every link into the glossary lands on a definition, and every
defined word is still used somewhere outside the glossary (in the docs or the code)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
_TERM = re.compile(r"^### (.+)$", re.MULTILINE)
_LINK = re.compile(r"glossary\.md#([\w-]+)")


def anchor(term: str) -> str:
    """The anchor GitHub (and every Markdown renderer of the docs) gives a heading."""
    return re.sub(r"[^\w\- ]", "", term.strip().lower()).replace(" ", "-")


def terms() -> list[str]:
    return _TERM.findall(GLOSSARY.read_text())


def pages() -> dict[Path, str]:
    """Every Markdown page but the glossary itself: the docs, the README and the
    contributors' ARCHITECTURE.md."""
    found = [p for p in (ROOT / "docs").rglob("*.md") if p != GLOSSARY]
    return {p: p.read_text() for p in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *found]}


def unlinked(words: list[str], texts: list[str]) -> list[str]:
    """The anchors of ``words`` no text links to."""
    linked = {a for text in texts for a in _LINK.findall(text)}
    return sorted(anchor(w) for w in words if anchor(w) not in linked)


def broken(words: list[str], texts: dict[str, str]) -> list[str]:
    """``page#anchor`` of every link into the glossary that no word of ``words`` defines."""
    defined = {anchor(w) for w in words}
    return sorted(f"{name}#{a}" for name, text in texts.items() for a in _LINK.findall(text)
                  if a not in defined)  # fmt: skip


def unused(words: list[str], texts: list[str]) -> list[str]:
    """The words no text uses (the target of a link into the glossary is not a use)."""
    haystack = "\n".join(_LINK.sub("", text) for text in texts).lower()
    return [w for w in words if w.lower() not in haystack]


def test_each_word_is_defined_once() -> None:
    defined = [anchor(t) for t in terms()]
    assert defined, "docs/glossary.md defines no word"
    assert len(defined) == len(set(defined)), f"defined twice: {sorted(defined)}"


def test_every_definition_is_linked_from_a_page() -> None:
    missing = unlinked(terms(), list(pages().values()))
    assert missing == [], f"no page links these glossary words (link their first use): {missing}"


def test_every_link_into_the_glossary_lands_on_a_definition() -> None:
    texts = {str(p.relative_to(ROOT)): text for p, text in pages().items()}
    assert broken(terms(), texts) == [], "links to words the glossary does not define"


def test_every_defined_word_is_still_used() -> None:
    code = [p.read_text() for p in (ROOT / "src" / "trainbus").rglob("*.py")]
    missing = unused(terms(), [*pages().values(), *code])
    assert missing == [], f"defined in docs/glossary.md but used nowhere else: {missing}"


def test_the_readme_lists_the_glossary() -> None:
    assert "(docs/glossary.md)" in (ROOT / "README.md").read_text()


def test_the_checks_fail_where_they_should() -> None:
    page = "A [poll point](glossary.md#poll-point) and a [gizmo](glossary.md#gizmo)."
    assert anchor("Rx scheduler") == "rx-scheduler"
    assert unlinked(["poll point", "doorbell"], [page]) == ["doorbell"]
    assert broken(["poll point"], {"p.md": page}) == ["p.md#gizmo"]
    # a link's target is not a use of the word; its text is
    assert unused(["gizmo", "poll point"], ["A [poll point](glossary.md#gizmo)."]) == ["gizmo"]
