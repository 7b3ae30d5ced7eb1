"""Where the CLI's output goes, and how an error becomes one line (or, under ``--json``, one JSON document)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading

from ..core.formatting import credentials, redact, strip_ansi
from ._exit import ArgumentUsageError, UsageError

__all__ = [
    "PROG",
    "UI",
    "table",
    "describe",
    "expected",
    "silence_stdout",
    "error_document",
    "report_error",
    "secrets_of",
]

PROG = "ulstore"


class UI:
    """Where output goes: text or JSON on stdout, progress and notes on stderr.

    Everything it prints is redacted: no ``user:password@`` of a URL on the command line (or of any
    other URL) reaches the terminal or a JSON document.
    """

    def __init__(self, args):
        self.json = args.json
        self.quiet = args.quiet
        self.tty = sys.stderr.isatty()
        self._bars = 0
        self.warnings: list[str] = []
        self.secrets = secrets_of(args)

    def redact(self, text: str) -> str:
        return redact(text, self.secrets)

    def out(self, line: str = "") -> None:
        if self.json:
            return
        line = self.redact(line)
        if self._bars:  # keep the bar on stderr intact
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
        else:
            print(line)

    def note(self, line: str) -> None:
        line = self.redact(line)
        if not self.quiet and not self.json:
            if self._bars:
                from tqdm import tqdm

                tqdm.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr)

    def warn(self, line: str) -> None:
        """A warning: on stderr as ``ulstore: warning: ...`` (not with --quiet), and in ``warnings`` for --json."""
        line = self.redact(line)
        self.warnings.append(line)
        if not self.json and not self.quiet:
            text = f"{PROG}: warning: {line}"
            if self._bars:
                from tqdm import tqdm

                tqdm.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr)

    def emit(self, doc) -> None:
        if self.json:
            if self.warnings:
                doc = {**doc, "warnings": list(self.warnings)}
            json.dump(_redacted(doc, self.secrets), sys.stdout, indent=2, default=_json_default)
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

    @contextlib.contextmanager
    def activity(self, desc: str):
        """A bar for work whose size is not known in advance: what is being done, and for how long.

        The store reports no progress from inside ``verify``, ``gc``, ``delete`` or
        ``inventory``; this keeps the terminal alive (elapsed time, ticking) while they run.
        """
        with self.bar(desc=desc, total=None, bar_format="{desc} {elapsed}") as bar:
            stop = threading.Event()

            def tick():
                while not stop.wait(0.5):
                    bar.refresh()

            ticker = threading.Thread(target=tick, daemon=True, name="ulstore-activity")
            if not bar.disable:
                ticker.start()
            try:
                yield bar
            finally:
                stop.set()
                if ticker.is_alive():
                    ticker.join()


def _json_default(obj):
    """numpy scalars as numbers; anything else (paths, dtypes) as text."""
    return obj.item() if hasattr(obj, "item") else str(obj)


def secrets_of(args) -> tuple[str, ...]:
    """The credentials (``user:password`` of ``scheme://user:password@host``) in the command's arguments."""
    found: list[str] = []
    for value in vars(args).values():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, str):
                found += credentials(v)
    return tuple(found)


def _redacted(doc, secrets: tuple[str, ...]):
    """``doc`` (a JSON document) with every string redacted (see :func:`ulstore.core.formatting.redact`)."""
    if isinstance(doc, str):
        return redact(doc, secrets)
    if isinstance(doc, dict):
        return {_redacted(k, secrets): _redacted(v, secrets) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_redacted(v, secrets) for v in doc]
    if hasattr(doc, "__fspath__"):  # a path: as text, like _json_default would
        return redact(str(doc), secrets)
    return doc


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


# the library's errors name the Python argument and the option: "pass overwrite=True (CLI: --force)"; the
# command line names only the option
_CLI_HINT = re.compile(r"\b[a-z_]+=\S*? \(CLI: ([^)]+)\)")


def describe(e: BaseException) -> str:
    """One line for ``e``: its message without terminal escapes, prefixed by its type unless it is ulstore's,
    in the command line's words.

    >>> describe(FileExistsError("out.pt: already exists; pass overwrite=True (CLI: --force) to replace it"))
    'FileExistsError: out.pt: already exists; pass --force to replace it'
    """
    from ..errors import UlstoreError

    text = strip_ansi(str(e)).strip()
    if isinstance(e, FileNotFoundError) and not isinstance(e, UlstoreError) and e.filename:
        text = f"{e.filename}: no such file or directory"
    elif isinstance(e, PermissionError) and not isinstance(e, UlstoreError) and e.filename:
        text = f"{e.filename}: permission denied"
    elif not isinstance(e, UlstoreError):
        text = f"{public_type(e)}: {text}" if text else public_type(e)
    text = _CLI_HINT.sub(r"\1", text)
    return " ".join(text.split()) or public_type(e)  # one line


def public_type(e: BaseException) -> str:
    """The type name ``--json`` reports for ``e``: its class's, or the nearest public base class's.

    Public: a class of :mod:`ulstore.errors`, one a public ulstore package exports (in its ``__all__``:
    ``ulstore.sync.BucketAccessError``), a built-in, or another package's class reachable by its name from
    a module path without private parts.  The CLI's usage errors are ``"UsageError"``.  A private class
    (``_Damaged``, ``StoreReadOnlyError``) is reported as the public class it derives from.
    """
    if isinstance(e, (UsageError, ArgumentUsageError)):
        return "UsageError"
    for cls in type(e).__mro__:
        if _is_public(cls):
            return cls.__name__
    return "Exception"  # (unreachable: every exception derives from a built-in)


def _is_public(cls: type) -> bool:
    name, module = cls.__name__, cls.__module__
    if name.startswith("_"):
        return False
    if module == "builtins":
        return True
    parts = module.split(".")
    public = ".".join(parts[: next((i for i, p in enumerate(parts) if p.startswith("_")), len(parts))])
    home = sys.modules.get(public)
    if home is None or getattr(home, name, None) is not cls:
        return False
    return name in getattr(home, "__all__", ()) if public.split(".")[0] == "ulstore" else True


def error_document(e: BaseException | None, status: int, message: str | None = None) -> dict:
    """The JSON form of an error (``--json``), one stable shape for every command and every error.

    ``{"error": {"type", "message", "exit_status", "step", "tensor", "key"}}``: every key is always
    present; ``step``, ``tensor`` and ``key`` are null unless the error is about one.
    """
    return {
        "error": {
            "type": public_type(e) if e is not None else "UsageError",
            "message": message if message is not None else (describe(e) if e is not None else ""),
            "exit_status": status,
            "step": getattr(e, "step", None),
            "tensor": getattr(e, "tensor", None),
            "key": getattr(e, "key", None),
        }
    }


def report_error(
    as_json: bool,
    e: BaseException | None,
    status: int,
    message: str | None = None,
    secrets: tuple[str, ...] = (),
) -> int:
    """Print an error on stderr: ``ulstore: error: ...`` or, with ``--json``, its :func:`error_document`.

    Credentials (``secrets``, and the userinfo of any URL) are redacted.
    """
    if as_json:
        json.dump(_redacted(error_document(e, status, message), secrets), sys.stderr, default=_json_default)
        sys.stderr.write("\n")
    else:
        text = message if message is not None else (describe(e) if e is not None else "")
        print(redact(f"{PROG}: error: {text}", secrets), file=sys.stderr)
    return status


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
