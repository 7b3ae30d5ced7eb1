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
  folder, its ``#anchor`` cut off.

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


def _exists(path: Path) -> bool:
    if any(c in path.name for c in "*?["):
        return any(path.parent.glob(path.name)) if path.parent.is_dir() else False
    return path.exists()


def named_paths(text: str, page: Path) -> list[tuple[int, str, Path]]:
    """(line, the path as written, where it points) of every repository path ``text`` (the text of
    ``page``) names."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in _PATH.finditer(line):
            written = m.group(0).rstrip(".")  # a path that ends a sentence
            found.append((lineno, written, REPO / written))
        for m in _LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if target and not _URL.match(target):
                found.append((lineno, m.group(1), (page.parent / target)))
    return found


def bad_paths(text: str, page: Path) -> list[str]:
    """``file:line: path`` of every path ``text`` names that does not exist in the repository."""
    rel = page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else str(page)
    out = []
    for lineno, written, target in named_paths(text, page):
        resolved = target.resolve()
        if written in ABSENT_ON_PURPOSE:
            continue
        if not resolved.is_relative_to(REPO) or not _exists(target):
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
        for _, written, _ in named_paths(page.read_text(encoding="utf-8"), page):
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
        ]
    )
    assert bad_paths(text, page) == [
        "docs/made-up.md:3: ulstore/no_such_module.py",
        "docs/made-up.md:3: tests/no_such_dir/test_x.py",
        "docs/made-up.md:4: ulstore/codec/*.no_such_ext",
        "docs/made-up.md:4: no-such-page.md",
        "docs/made-up.md:4: ../../etc/passwd",
    ]
