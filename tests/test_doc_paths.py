"""Every repository path a doc names exists.

A reader follows ``tests/sync/test_sync_e2e.py`` or ``[layout.md](layout.md)`` to the file; when a
module moves and the doc does not, the reader finds nothing.  Checked: ``README.md``,
``docs/*.md`` (``api.md`` and ``cli.md`` included: a wrong path there is a wrong docstring or help
text), ``benchmarks/README.md`` and ``examples/README.md`` if present.

What counts as a path:

- a token that starts with one of the repository's top-level folders (``ulstore/``, ``tests/``,
  ``benchmarks/``, ``examples/``, ``codec_ext/``, ``docs/``, ``.ci/``), anywhere in the page
  (prose, inline code, code blocks), read from the repository root; a pytest node id's
  ``::test...`` is cut off, and a glob (``ulstore/codec/_kernels*.so``) must match something;
- the target of a Markdown link (``[text](target)``) that is not a URL, read from the page's
  folder; its ``#anchor``, on a Markdown page, must be one of that page's headings (GitHub's
  slugs: lower case, punctuation dropped, spaces to hyphens, ``-1`` for a repeated heading).

``CHANGELOG.md`` is left out on purpose: each entry tells what changed when it was written, in
the paths of that day (``codec/_reference_entries.py``, ``sync/_in_place.py``, the
``benchmarks/.cache/`` of old versions); rewriting them to today's paths would make the history
false, and a path there is not an instruction to open a file.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("ulstore", "tests", "benchmarks", "examples", "codec_ext", "docs", ".ci")
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *[p for p in (REPO / "benchmarks" / "README.md", REPO / "examples" / "README.md") if p.exists()],
]

#: a root-relative path: a top-level folder, then path characters; not inside a longer path or URL
_PATH = re.compile(r"(?<![\w./:-])(?:" + "|".join(map(re.escape, ROOTS)) + r")/[\w.*/-]*")
#: a Markdown link's target (inline links; no spaces in the targets these docs use)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: paths a page names because they do not exist (keep this short; say why)
ABSENT_ON_PURPOSE = {
    "benchmarks/.cache/": "benchmarks/README.md names the cache folder old versions left, which --clean reports",
}
_URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, s3: ...


_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$")
_FENCE = re.compile(r"^(```|~~~)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (headings inside code blocks are code)."""
    seen: dict[str, int] = {}
    out, in_code = set(), False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        m = None if in_code else _HEADING.match(line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _exists(path: Path) -> bool:
    if any(c in path.name for c in "*?["):
        return any(path.parent.glob(path.name)) if path.parent.is_dir() else False
    return path.exists()


def named_paths(text: str, page: Path) -> list[tuple[int, str, Path, str]]:
    """(line, the path as written, where it points, its ``#anchor`` or "") of every repository path
    ``text`` (the text of ``page``) names."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in _PATH.finditer(line):
            written = m.group(0).rstrip(".")  # a path that ends a sentence
            found.append((lineno, written, REPO / written, ""))
        for m in _LINK.finditer(line):
            target, _, anchor = m.group(1).partition("#")
            if not _URL.match(target):
                found.append((lineno, m.group(1), page.parent / target if target else page, anchor))
    return found


def _anchor_missing(target: Path, anchor: str, text_of) -> bool:
    return bool(anchor) and target.suffix == ".md" and anchor not in anchors(text_of(target))


def bad_paths(text: str, page: Path) -> list[str]:
    """``file:line: path`` of every path ``text`` names that does not exist in the repository (or whose
    ``#anchor`` is no heading of the page it names)."""
    rel = page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else str(page)

    def text_of(p: Path) -> str:
        return text if p == page else p.read_text(encoding="utf-8")

    out = []
    for lineno, written, target, anchor in named_paths(text, page):
        resolved = target.resolve()
        if written in ABSENT_ON_PURPOSE:
            continue
        if target == page:  # a link to a heading of this page
            if _anchor_missing(page, anchor, text_of):
                out.append(f"{rel}:{lineno}: {written}")
        elif not resolved.is_relative_to(REPO) or not _exists(target) or _anchor_missing(target, anchor, text_of):
            out.append(f"{rel}:{lineno}: {written}")
    return out


def test_every_path_a_doc_names_exists():
    assert len(PAGES) >= 10, PAGES  # the pages are found
    bad = [b for page in PAGES for b in bad_paths(page.read_text(encoding="utf-8"), page)]
    assert not bad, f"{len(bad)} paths named in the docs do not exist (fix the doc, or the path):\n" + "\n".join(bad)


def test_the_pages_name_paths_at_all():
    """The scan is not vacuous: the pages do name paths, of both kinds."""
    kinds = {"root": 0, "link": 0}
    for page in PAGES:
        for _, written, _, _ in named_paths(page.read_text(encoding="utf-8"), page):
            kinds["root" if written.split("/")[0] in ROOTS else "link"] += 1
    assert kinds["root"] >= 20 and kinds["link"] >= 10, kinds


def test_the_checker_catches_made_up_paths():
    page = REPO / "docs" / "made-up.md"
    text = "\n".join(
        [
            "# A page",
            "The checker lives in `tests/test_doc_paths.py` and [the README](../README.md#quickstart).",
            "See `ulstore/no_such_module.py` and tests/no_such_dir/test_x.py::test_y[1].",
            "Also [a page](no-such-page.md), [outside](../../etc/passwd) and `ulstore/codec/*.no_such_ext`.",
            "Not paths: https://example.com/tests/x.py, s3://bucket/docs/y.md, runs/tests/z.py.",
            "## A heading, with punctuation: `code`",
            "Anchors: [ok](#a-heading-with-punctuation-code), [bad](#no-such-heading),",
            "[ok](performance.md#the-demo), [bad](performance.md#no-such-section).",
        ]
    )
    assert bad_paths(text, page) == [
        "docs/made-up.md:3: ulstore/no_such_module.py",
        "docs/made-up.md:3: tests/no_such_dir/test_x.py",
        "docs/made-up.md:4: ulstore/codec/*.no_such_ext",
        "docs/made-up.md:4: no-such-page.md",
        "docs/made-up.md:4: ../../etc/passwd",
        "docs/made-up.md:7: #no-such-heading",
        "docs/made-up.md:8: performance.md#no-such-section",
    ]


def test_the_sync_reference_stays_a_reference():
    """docs/sync.md is what weight sync is today, in at most 300 lines; its history lives in CHANGELOG.md."""
    lines = (REPO / "docs" / "sync.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"docs/sync.md has {len(lines)} lines: move history to CHANGELOG.md"
