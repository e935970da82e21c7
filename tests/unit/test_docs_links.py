"""Every relative link in README.md and docs/*.md resolves: the file (or folder) exists and a `#anchor` names a
heading of it, as GitHub renders the anchor (lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_check import ROOT, doc_files

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks, with inline code removed."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeats numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            out.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    out |= set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", path.read_text()))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        found += [(number, m.group(1)) for m in _LINK.finditer(line)]
        ref = _REFERENCE.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return [(n, t) for n, t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, mailto:, ...


def broken(path: Path) -> list[str]:
    """What does not resolve among the relative links of one file."""
    bad = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            bad.append(f"{where}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    bad = broken(path)
    assert not bad, "\n".join(bad)


def test_there_are_links_to_check():
    assert sum(len(links(p)) for p in doc_files()) >= 20


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.unit.test_docs_links.ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# The CLI: `tokenloop-cli`\n## Errors\n## Errors\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#the-cli-tokenloop-cli) [b](other.md#errors-1) [c](#top)\n# Top\n"
                   "[d](nope.md) [e](other.md#nope) `[f](inline.md)` [g](https://example.com/x)\n"
                   "```text\n[h](fenced.md)\n```\n")
    assert broken(doc) == ["doc.md:3: nope.md: no such file nope.md",
                           "doc.md:3: other.md#nope: no heading with the anchor #nope in other.md"]


@pytest.mark.parametrize(("heading", "anchor"), [
    ("The CLI: `tokenloop-cli`", "the-cli-tokenloop-cli"), ("Bounding a schema", "bounding-a-schema"),
    ("Refusals (INVALID_ARGUMENT, each tested exactly in `tests/x.py`)",
     "refusals-invalid_argument-each-tested-exactly-in-testsxpy"),
    ("tokenloop.v1: the `structured` oneof", "tokenloopv1-the-structured-oneof"),
])
def test_slugs_follow_github(heading, anchor):
    assert slug(heading) == anchor
