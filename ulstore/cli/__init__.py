"""The ``ulstore`` command line.

Conventions
    ``--help`` on every command; ``--json`` prints one JSON document on stdout
    for scripts; progress bars go to stderr, only on a terminal, never with
    ``--quiet``.  Exit status: 0 success, 1 an error in the data or the
    environment (bad checkpoint, missing step, unreachable store, damaged
    blob), 2 a usage error (unknown option, bad argument).  Errors print one
    line, ``ulstore: error: ...``, on stderr; ``--debug`` shows the traceback.

A URL is anything :func:`ulstore.open` accepts: a local path, ``s3://bucket/run``,
``gs://...``, ``memory://...``.  Filesystem settings come from ``-o KEY=VALUE``
(repeatable; VALUE is parsed as JSON when it can be) or from the environment
variable ``ULSTORE_STORAGE_OPTIONS`` (a JSON object).

Examples
--------
>>> import contextlib, io, json, tempfile
>>> d = tempfile.mkdtemp()
>>> with contextlib.redirect_stdout(io.StringIO()) as out:
...     status = main(["init", f"{d}/traj", "--json"])
>>> status, json.loads(out.getvalue())["steps"]
(0, 0)
"""

from __future__ import annotations

import sys
import traceback

from ._commands import EXIT_ERROR, EXIT_OK, EXIT_USAGE, UsageError
from ._parser import build_parser
from ._ui import PROG, UI, describe, expected, silence_stdout

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE"]


def main(argv=None) -> int:
    """Run ``ulstore`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) and usage errors (2)
        return int(e.code or 0)
    ui = UI(args)
    try:
        return args.func(args, ui) or EXIT_OK
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        print(f"{PROG}: error: {describe(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `ulstore log X | head`
        silence_stdout()
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 -- the one place that turns errors into a message
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug or expected(e) else " (unexpected; rerun with --debug for the traceback)"
        print(f"{PROG}: error: {describe(e)}{hint}", file=sys.stderr)
        return EXIT_ERROR
