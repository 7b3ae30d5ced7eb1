"""The ``ulstore`` command line.

Conventions
    ``--help`` on every command; ``--json`` prints one JSON document on stdout
    for scripts; progress bars go to stderr, only on a terminal, never with
    ``--quiet``.  Exit status: 0 success, 1 an error in the data or the
    environment (bad checkpoint, missing step, unreachable store, damaged
    blob), 2 a usage error (unknown option, bad argument).  A bare ``ulstore``
    prints the help on stdout and exits 0, as ``pip`` does.  Errors print one
    line, ``ulstore: error: ...``, on stderr; ``--debug`` shows the traceback.
    With ``--json`` an error is one JSON document on stderr instead, always of
    the shape ``{"error": {"type", "message", "exit_status", "step", "tensor",
    "key"}}`` (usage errors too); warnings go to the ``warnings`` list of the
    document on stdout.

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
import warnings

from ..core.formatting import redact
from ._exit import EXIT_ERROR, EXIT_OK, EXIT_USAGE, ArgumentUsageError, UsageError
from ._parser import build_parser, wants_json
from ._ui import UI, describe, expected, report_error, silence_stdout

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE"]


def main(argv=None) -> int:
    """Run ``ulstore`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:  # a bare `ulstore`: the help, as `pip` (git prints it too, but exits 1)
        parser.print_help()
        return EXIT_OK
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help and --version
        return int(e.code or 0)
    except ArgumentUsageError as e:
        if wants_json(argv):
            return report_error(True, None, EXIT_USAGE, e.message)
        e.parser.print_usage(sys.stderr)
        print(redact(f"{e.parser.prog}: error: {e.message}"), file=sys.stderr)
        return EXIT_USAGE
    ui = UI(args)
    try:
        with warnings.catch_warnings():  # a library warning is one of the command's: `ulstore: warning: ...`
            warnings.showwarning = lambda message, *rest, **kw: ui.warn(str(message))
            return args.func(args, ui) or EXIT_OK
    except KeyboardInterrupt as e:
        if args.json:
            return report_error(True, e, 130, "interrupted")
        print("ulstore: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        return report_error(args.json, e, EXIT_USAGE, secrets=ui.secrets)
    except BrokenPipeError:  # `ulstore log X | head`
        silence_stdout()
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 -- the one place that turns errors into a message
        if args.debug:
            print(ui.redact(traceback.format_exc()), file=sys.stderr, end="")
        if args.json:
            return report_error(True, e, EXIT_ERROR, secrets=ui.secrets)
        hint = "" if args.debug or expected(e) else " (unexpected; rerun with --debug for the traceback)"
        return report_error(False, e, EXIT_ERROR, describe(e) + hint, secrets=ui.secrets)
