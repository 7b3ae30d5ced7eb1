"""Where the CLI's output goes, and how an error becomes one line."""

from __future__ import annotations

import contextlib
import json
import os
import sys

__all__ = ["PROG", "UI", "table", "describe", "expected", "silence_stdout"]

PROG = "ulstore"


class UI:
    """Where output goes: text or JSON on stdout, progress and notes on stderr."""

    def __init__(self, args):
        self.json = args.json
        self.quiet = args.quiet
        self.tty = sys.stderr.isatty()
        self._bars = 0

    def out(self, line: str = "") -> None:
        if self.json:
            return
        if self._bars:  # keep the bar on stderr intact
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
        else:
            print(line)

    def note(self, line: str) -> None:
        if not self.quiet and not self.json:
            print(line, file=sys.stderr)

    def emit(self, doc) -> None:
        if self.json:
            json.dump(doc, sys.stdout, indent=2, default=_json_default)
            sys.stdout.write("\n")

    @property
    def progress(self) -> bool:
        return self.tty and not self.quiet

    @contextlib.contextmanager
    def bar(self, **kw):
        from tqdm import tqdm

        with tqdm(disable=not self.progress, file=sys.stderr, dynamic_ncols=True, leave=False, **kw) as bar:
            self._bars += not bar.disable
            try:
                yield bar
            finally:
                self._bars -= not bar.disable


def _json_default(obj):
    """numpy scalars as numbers; anything else (paths, dtypes) as text."""
    return obj.item() if hasattr(obj, "item") else str(obj)


def expected(e: BaseException) -> bool:
    from ..errors import UlstoreError

    return isinstance(e, (UlstoreError, OSError, ValueError)) or type(e).__module__.split(".")[0] in (
        "botocore",
        "aiohttp",
        "s3fs",
        "gcsfs",
        "adlfs",
        "fsspec",
    )


def describe(e: BaseException) -> str:
    from ..errors import UlstoreError

    text = str(e).strip()
    if isinstance(e, FileNotFoundError) and not isinstance(e, UlstoreError) and e.filename:
        text = f"{e.filename}: no such file or directory"
    elif isinstance(e, PermissionError) and not isinstance(e, UlstoreError) and e.filename:
        text = f"{e.filename}: permission denied"
    elif not isinstance(e, UlstoreError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return " ".join(text.split()) or type(e).__name__  # one line


def silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


def table(rows: list[list], headers: list[str], align: str) -> list[str]:
    """Plain text columns; ``align`` has one of ``<`` / ``>`` per column."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)]
        lines.append("  ".join(parts).rstrip())
    return lines
