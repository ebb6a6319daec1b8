"""Citations in the code resolve to the repository's own documentation under docs/.

Every *.py file under services/, tests/, bench/ and tools/, and the top-level README.md, is
scanned for:

- field-failure ids (`BUG-07`, `ART#883`): each must be a heading of docs/failure-cases.md;
- paths `docs/<name>.md` (optionally `#anchor`): the file must exist in docs/, and the anchor
  must be the GitHub slug of one of its headings;
- references to documents outside the repository (the words in `OUTSIDE`): none may remain;
- convention ids (`house style C4`): each must be a heading of docs/conventions.md.

Each check reports every offender (file:line) in one failure message.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
SCANNED_DIRS = ("services", "tests", "bench", "tools")
THIS_FILE = Path(__file__).resolve()

CASE_ID = re.compile(r"\b(?:BUG-\d+|ART#\d+)")
DOC_PATH = re.compile(r"(?<![\w./-])docs/([A-Za-z0-9_-]+)\.md(?:#([A-Za-z0-9_-]+))?")
HOUSE_STYLE = re.compile(r"house style (C\d+)\b")
OUTSIDE = (
    "DESIGN.md",
    "shared/docs",
    "shared/cases",
    "field-failures.md",
    "machine-notes.md",
    "house-style.md",
)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def scanned_files(root: Path = ROOT) -> list[Path]:
    """Every file whose citations must resolve (this test file excluded)."""
    files = [root / "README.md"]
    for name in SCANNED_DIRS:
        files += sorted((root / name).rglob("*.py"))
    return [f for f in files if f.is_file() and f.resolve() != THIS_FILE]


def headings(doc: Path) -> list[str]:
    """The heading texts of a Markdown file (fenced code blocks skipped)."""
    out, fenced = [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            out.append(match.group(1))
    return out


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than hyphens and
    underscores dropped, spaces turned into hyphens."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for text in headings(doc):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def find_offenders(files: list[Path], docs: Path = DOCS) -> dict[str, list[str]]:
    """Broken references per check ("case", "doc", "outside", "style"), as `file:line: what`."""
    failure_headings = (
        headings(docs / "failure-cases.md") if (docs / "failure-cases.md").is_file() else []
    )
    style_headings = (
        headings(docs / "conventions.md") if (docs / "conventions.md").is_file() else []
    )
    found: dict[str, list[str]] = {"case": [], "doc": [], "outside": [], "style": []}
    for path in files:
        try:
            where_file = path.resolve().relative_to(ROOT)
        except ValueError:
            where_file = path
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, start=1):
            where = f"{where_file}:{number}"
            for case in CASE_ID.findall(line):
                if not any(
                    re.search(rf"(?<![\w#-]){re.escape(case)}(?!\d)", h) for h in failure_headings
                ):
                    found["case"].append(f"{where}: {case} is no heading of docs/failure-cases.md")
            for name, anchor in DOC_PATH.findall(line):
                doc = docs / f"{name}.md"
                if not doc.is_file():
                    found["doc"].append(f"{where}: docs/{name}.md does not exist")
                elif anchor and anchor not in anchors(doc):
                    found["doc"].append(f"{where}: docs/{name}.md has no heading #{anchor}")
            for word in OUTSIDE:
                if word in line:
                    found["outside"].append(f"{where}: {word} points outside the repository")
            for style in HOUSE_STYLE.findall(line):
                if not any(re.search(rf"\b{style}\b", h) for h in style_headings):
                    found["style"].append(
                        f"{where}: house style {style} is no heading of docs/conventions.md"
                    )
    return found


def _report(kind: str) -> list[str]:
    return find_offenders(scanned_files())[kind]


def test_failure_case_ids_are_headings_of_failure_cases():
    offenders = _report("case")
    assert not offenders, "\n".join(offenders)


def test_doc_paths_and_anchors_exist():
    offenders = _report("doc")
    assert not offenders, "\n".join(offenders)


def test_no_reference_points_outside_the_repository():
    offenders = _report("outside")
    assert not offenders, "\n".join(offenders)


def test_house_style_ids_are_headings_of_conventions():
    offenders = _report("style")
    assert not offenders, "\n".join(offenders)


def test_planted_bad_references_are_all_reported(tmp_path):
    # the unknown ids are put together here so that this file cites none itself
    bug, art = "BUG" + "-99", "ART" + "#1"
    planted = tmp_path / "planted.py"
    planted.write_text(
        f'"""See {bug} and {art} in docs/nope.md, docs/sessions.md#no-such-heading,\n'
        "DESIGN.md section 4 and house style C99.\n"
        'Fine: BUG-07, docs/sessions.md#forks-and-segments, house style C4."""\n',
        encoding="utf-8",
    )
    found = find_offenders([planted])
    assert [o.split(": ", 1)[1] for o in found["case"]] == [
        f"{bug} is no heading of docs/failure-cases.md",
        f"{art} is no heading of docs/failure-cases.md",
    ]
    assert [o.split(": ", 1)[1] for o in found["doc"]] == [
        "docs/nope.md does not exist",
        "docs/sessions.md has no heading #no-such-heading",
    ]
    assert found["outside"] == [f"{planted}:2: DESIGN.md points outside the repository"]
    assert found["style"] == [f"{planted}:2: house style C99 is no heading of docs/conventions.md"]


def test_slugs_follow_github_rules():
    assert slug("BUG-07 — Rollout logprobs, or T") == "bug-07--rollout-logprobs-or-t"
    assert slug("POST /generate") == "post-generate"
    assert slug("Running a real SGLang server") == "running-a-real-sglang-server"
