"""The ``ulstore`` argument parser: every command, option, help text and example."""

from __future__ import annotations

import argparse
import difflib
import math
import re

from . import _commands as C
from ._exit import ArgumentUsageError
from ._ui import PROG

__all__ = ["build_parser", "wants_json"]

_DESCRIPTION = """\
Store every checkpoint of a training run, small and exact.

ulstore keeps a trajectory of checkpoints as delta-coded, content-addressed
steps, on local disk or any object store fsspec reaches, and gives every step
back bit for bit, lazily, one slice at a time."""

_EPILOG = """\
exit status: 0 ok, 1 error (data, file, store), 2 usage error.
Start with `ulstore demo`; `ulstore COMMAND --help` describes each command."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the hand-wrapped descriptions and examples as written."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`ArgumentUsageError` (the caller prints it, as text or JSON)
    and adds "did you mean" to an invalid choice (a subcommand typo, a misspelt --format)."""

    def error(self, message: str):  # raises instead of exiting
        raise ArgumentUsageError(self, did_you_mean(message))

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown option is reported by its command, with the closest option suggested."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(getattr(parsed, "command", None))
            options = [o for a in command._actions for o in a.option_strings]
            hints = [
                f"{x!r}: did you mean {close[0]!r}?"
                for x in extras
                if x.startswith("-") and (close := difflib.get_close_matches(x.split("=")[0], options, n=1, cutoff=0.6))
            ]
            message = f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")
            command.error(message)
        return parsed

    def _command_parser(self, name) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return self


_INVALID_CHOICE = re.compile(r"invalid choice: '?([^'(]*?)'? \(choose from (.*)\)")

#: what other tools (git, dvc, docker, pip) call a command: the name a user tries first is not a typo of ours
_OTHER_NAMES = {
    "show": "ls",
    "list": "ls",
    "info": "log",
    "history": "log",
    "import": "add",
    "commit": "add",
    "create": "init",
    "new": "init",
    "checkout": "export",
    "save": "export",
    "delete": "rm",
    "remove": "rm",
    "check": "verify",
    "fsck": "verify",
    "compare": "diff",
    "prune": "gc",
    "size": "stats",
    "du": "stats",
}


def did_you_mean(message: str) -> str:
    """argparse's "invalid choice" message with the closest choice suggested (or the command another tool's
    name stands for: ``show`` is ``ls``).

    >>> did_you_mean("argument COMMAND: invalid choice: 'lgo' (choose from 'init', 'log', 'ls')")
    "argument COMMAND: invalid choice: 'lgo' (choose from 'init', 'log', 'ls'); did you mean 'log'?"
    >>> did_you_mean("argument COMMAND: invalid choice: 'show' (choose from 'init', 'log', 'ls')")
    "argument COMMAND: invalid choice: 'show' (choose from 'init', 'log', 'ls'); did you mean 'ls'?"
    """
    m = _INVALID_CHOICE.search(message)
    if not m:
        return message
    choices = [c.strip().strip("'") for c in m.group(2).split(",")]
    other = _OTHER_NAMES.get(m.group(1).lower())
    close = [other] if other in choices else difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.5)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def wants_json(argv) -> bool:
    """Whether ``--json`` is among the options (before a ``--``): errors of parsing then are JSON too."""
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ulstore`` (also renders ``docs/cli.md``).

    Examples
    --------
    >>> build_parser().parse_args(["log", "runs/a"]).command
    'log'
    """
    # Options every command takes; SUPPRESS keeps a sub-command from resetting
    # what was given before it (`ulstore --json log X` and `ulstore log X --json`).
    common = _Parser(add_help=False)
    g = common.add_argument_group("output")
    g.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document on stdout instead of text",
    )
    g.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars, no messages on stderr"
    )
    g.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
    )
    store = _Parser(add_help=False)
    store.add_argument(
        "-o",
        "--storage-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="storage_options",
        help="fsspec filesystem option for remote URLs, e.g. -o endpoint_url=http://host:9000 "
        "(repeatable; VALUE is parsed as JSON if it can be)",
    )

    parser = _Parser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--json", action="store_true", default=False, help=argparse.SUPPRESS)
    parser.add_argument("-q", "--quiet", action="store_true", default=False, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", default=False, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True

    def command(name, help, description, examples, parents=(common, store)):
        p = sub.add_parser(
            name,
            help=help,
            description=f"{description}\n\nexamples:\n{examples}",
            parents=list(parents),
            formatter_class=_Formatter,
        )
        p.set_defaults(func=getattr(C, f"_cmd_{name}"))
        return p

    p = command(
        "init",
        "create an empty trajectory",
        "Create an empty trajectory at URL (fails if one exists).",
        "  ulstore init runs/llama-ft\n  ulstore init s3://bucket/runs/llama-ft --anchor-every 32",
    )
    p.add_argument("url", metavar="URL", help="where to create it: a local path or an fsspec URL")
    _settings_args(p)

    p = command(
        "add",
        "import checkpoint files as new steps",
        "Import checkpoints as new steps, oldest step first.\n\n"
        "A CHECKPOINT is a .safetensors file, a Hugging Face model directory (sharded with\n"
        "model.safetensors.index.json, or one model.safetensors), a torch state dict\n"
        "(.pt/.pth/.bin, needs PyTorch) or an .npz.  The step comes from the name unless\n"
        "--step is given: step_001200.safetensors and checkpoint-1200/ are step 1200.\n"
        "Each step is committed atomically; file metadata and tied tensors are kept so\n"
        "that `ulstore export` gives the same tensors back.  A step is delta-coded\n"
        "against the tensors of its parent that have the same names, dtypes and shapes:\n"
        "add warns when under half of the parent's bytes match, and says why (other\n"
        "names: --rename-prefix lines them up; another dtype or shape: it names them).",
        "  ulstore add runs/a ckpts/step_*.safetensors\n"
        "  ulstore add runs/a out/checkpoint-1200/\n"
        "  ulstore add runs/a sft.pt --step 5000 --parent 1200 --branch sft\n"
        "  ulstore add runs/a classifier/ --step 6000 --parent 1200 --branch cls --rename-prefix bert.=",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("checkpoints", metavar="CHECKPOINT", nargs="+", help="checkpoint files or directories")
    p.add_argument("--step", type=_nonneg_int, metavar="N", help="step number (only with one CHECKPOINT)")
    parent = p.add_mutually_exclusive_group()
    parent.add_argument(
        "--parent",
        metavar="S",
        type=_step_or_ref,
        help="step or ref the first checkpoint derives from (default: the head of --branch)",
    )
    parent.add_argument("--root", action="store_true", help="start a new chain: the first checkpoint has no parent")
    p.add_argument("--branch", metavar="B", help="branch to advance (default: main)")
    p.add_argument(
        "--rename-prefix",
        metavar="OLD=NEW",
        action="append",
        type=_prefix_pair,
        help="store tensors named OLD... as NEW... (repeatable), so that a fine-tune saved under other names "
        "(bert.encoder... vs encoder...) is a delta against its base; export gives the file's names back",
    )
    p.add_argument("--init", action="store_true", help="create the trajectory if it does not exist")
    _settings_args(p)

    p = command(
        "log",
        "list steps, newest first",
        "List steps, newest first: parent, anchor distance, tensors, raw size, stored\n"
        "size (the bytes the step added: its new blobs, step document and table blocks,\n"
        "as `ulstore stats` counts them), refs and the file each step was imported\n"
        "from, then the totals of the steps listed.  With STEP (a step or a ref), only\n"
        "that step's ancestry.",
        "  ulstore log runs/a\n  ulstore log runs/a -n 5\n  ulstore log runs/a sft --json",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("start", metavar="STEP", nargs="?", type=_step_or_ref, help="show the ancestry of this step or ref")
    p.add_argument(
        "-n",
        "--max-count",
        metavar="N",
        type=_nonneg_int,
        default=0,
        help="only the N newest steps (as `git log -n`; default 0: all)",
    )

    p = command(
        "ls",
        "list the tensors of a step",
        "List the tensors of a step: name, dtype, shape, size (nothing is decoded).",
        "  ulstore ls runs/a            # the head of branch main\n  ulstore ls runs/a 1200\n"
        "  ulstore ls runs/a sft --json",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument(
        "step",
        metavar="STEP",
        type=_step_or_ref,
        nargs="?",
        default="main",
        help="a step or a ref (branch) name (default: main, the newest step of branch main)",
    )

    p = command(
        "export",
        "write a step as a checkpoint",
        "Write a step as a checkpoint; the format follows from OUT:\n"
        "  *.safetensors      one safetensors file (file metadata kept)\n"
        "  DIR/ or no suffix  a Hugging Face directory; sharded with --shard-size, or as\n"
        "                     the imported checkpoint was; else one model.safetensors\n"
        "  *.pt *.pth *.bin   a torch state dict (tied tensors share storage again)\n"
        "  *.npz              a numpy archive\n"
        "Tensor bytes are exactly the imported ones.  The output appears atomically.",
        "  ulstore export runs/a 1200 model.safetensors\n"
        "  ulstore export runs/a main out/checkpoint-1200 --shard-size 5GB\n"
        "  ulstore export runs/a 1200 state.pt",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", type=_step_or_ref, help="a step or a ref name")
    p.add_argument("out", metavar="OUT", help="output file or directory")
    p.add_argument("--shard-size", metavar="SIZE", help="shard limit, e.g. 5GB, 500MiB or a byte count")
    p.add_argument(
        "--format", choices=["safetensors", "sharded", "torch", "npz"], help="override the format chosen from OUT"
    )
    p.add_argument("-f", "--force", action="store_true", help="replace OUT if it exists")

    p = command(
        "verify",
        "re-read and check every blob and manifest",
        "Re-read every blob and manifest reachable from STEP (default: all steps and refs),\n"
        "check each against its hash, decode it and check the result.  Exit status 1 if\n"
        "anything is damaged.",
        "  ulstore verify runs/a\n  ulstore verify runs/a 1200",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", nargs="?", type=_step_or_ref, help="only this step (and its references)")

    p = command(
        "stats",
        "raw vs stored size, per step and per tensor",
        "Raw size (the tensors as stored in a checkpoint) against stored size (new blobs +\n"
        "manifest), per step and per tensor, in bytes and bits per weight.  A blob is\n"
        "charged to the first step that uses it.  --plot draws the per-step sizes\n"
        "(needs matplotlib, the `plot` extra).",
        "  ulstore stats runs/a\n  ulstore stats runs/a --plot sizes.png --top 5",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("--plot", metavar="FILE.png", help="also draw stored vs raw size per step to this PNG")
    p.add_argument(
        "--top",
        metavar="N",
        type=_nonneg_int,
        default=15,
        help="tensors to list, largest stored first (default 15; 0: all)",
    )

    p = command(
        "diff",
        "which tensors changed between two steps, and how much",
        "Compare step B with step A, tensor by tensor: the fraction of elements that\n"
        "changed (different bits), the relative L2 change ||B - A|| / ||A|| (float64) and\n"
        "the largest absolute change, most changed first.  NaN and infinite values are\n"
        "left out of the norms and counted apart (`nonfinite`).  Only the chunks of B\n"
        "whose content differs from A's are decoded.  --plot draws a heatmap of tensors\n"
        "(rows, grouped by layer) against steps: each step between A and B along B's\n"
        "ancestry compared with its parent (needs matplotlib: the `plot` extra).",
        "  ulstore diff runs/rl 1200 1201\n"
        "  ulstore diff runs/rl 1200 main --top 0 --json\n"
        "  ulstore diff runs/rl 1200 1300 --plot moved.png --metric rel_l2",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("a", metavar="A", type=_step_or_ref, help="the step (or ref) to compare against")
    p.add_argument("b", metavar="B", type=_step_or_ref, help="the step (or ref) to compare")
    p.add_argument(
        "--top",
        metavar="N",
        type=_nonneg_int,
        default=20,
        help="tensors to list, most changed first (default 20; 0: all)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="also draw a heatmap of every step from A to B to this PNG")
    p.add_argument(
        "--metric",
        choices=["changed", "rel_l2"],
        default="changed",
        help="what --plot colours: the fraction of elements changed (default) or the relative L2 change",
    )

    p = command(
        "gc",
        "remove packs no step uses, repack mostly-dead ones",
        "Remove packs that no step names (left by `ulstore rm` or by a crashed commit),\n"
        "and repack packs that are mostly dead (their live blobs move to a new pack).\n"
        "While another process may be committing, pass --older-than a bound on how\n"
        "long a commit takes.",
        "  ulstore gc runs/a\n  ulstore gc s3://bucket/runs/a --older-than 1h",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument(
        "--older-than",
        metavar="AGE",
        type=_duration,
        default=0.0,
        help="only remove packs (and temporary files) at least this old: seconds, or a number "
        "with s, m, h or d (30m, 1h, 2d; default 0)",
    )

    p = command(
        "upgrade",
        "convert a trajectory of the old format 1 to format 2",
        "Convert a format-1 trajectory (one object per chunk, JSON manifests) into a new\n"
        "format-2 trajectory at DEST: every step, parent, ref, metadata and creation\n"
        "time is kept, every value bit for bit.  SRC is only read.",
        "  ulstore upgrade runs/old runs/new\n  ulstore upgrade s3://bucket/old s3://bucket/new",
    )
    p.add_argument("url", metavar="SRC", help="the format-1 trajectory")
    p.add_argument("dest", metavar="DEST", help="where to write the format-2 trajectory (must not exist)")

    p = command(
        "rm",
        "delete a step",
        "Delete a step; every other step stays readable, exactly (chunks coded against it\n"
        "are re-encoded, its children re-parented, refs on it moved to its parent).\n"
        "Then run `ulstore gc URL` to free its packs.",
        "  ulstore rm runs/a 1200",
    )
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", type=_step_or_ref, help="the step to delete")

    p = command(
        "demo",
        "train a small model on this CPU, store every step, show sizes",
        "Train a small language model for real on the CPU, store a bf16 checkpoint after\n"
        "every step, print the size against raw safetensors and zstd, read a slice of an\n"
        "old step back lazily, verify, say where the data lives and how long it all took.\n"
        "DIR defaults to ./ulstore-demo; an earlier demo there is replaced.",
        "  ulstore demo\n  ulstore demo /tmp/demo --steps 20 --preset tiny",
        parents=(common,),
    )
    p.add_argument("dir", metavar="DIR", nargs="?", default=None, help="where to store the trajectory")
    p.add_argument(
        "--steps", type=_positive_int, default=None, metavar="N", help="optimizer steps to train and store (default 60)"
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "small", "bench"],
        default=None,
        help="model size: tiny ~54K, small ~1.8M (default), bench ~13M parameters",
    )
    return parser


def _settings_args(p) -> None:
    anchors = p.add_mutually_exclusive_group()
    anchors.add_argument(
        "--anchor-every",
        metavar="N",
        type=_nonneg_int,
        help="a full anchor every N steps along a chain (new trajectories; default: an anchor when reading the "
        "next step would cost more than 2x reading an anchor)",
    )
    anchors.add_argument(
        "--anchor-cost",
        metavar="K",
        type=_positive_float,
        help="an anchor when reading the next step as a delta would cost more than K times reading an anchor "
        "(new trajectories; default 2: larger K, fewer anchors, smaller and slower to read)",
    )
    p.add_argument(
        "--chunk-bytes",
        metavar="N",
        type=_positive_int,
        help="target chunk size in bytes for new tensors (new trajectories; default 4 MiB)",
    )


def _version() -> str:
    from .. import __version__

    return __version__


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """Seconds from ``3600``, ``90s``, ``30m``, ``1h`` or ``2d`` (what ``find -mmin`` and ``systemd`` users type).

    >>> _duration("3600"), _duration("1.5h"), _duration("30m"), _duration("2d")
    (3600.0, 5400.0, 1800.0, 172800.0)
    """
    number, unit = (text[:-1], text[-1].lower()) if text[-1:].lower() in _UNITS else (text, "s")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected an age: seconds, or a number with s, m, h or d (90s, 30m, 1h, 2d), got {text!r}"
        )
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _nonneg_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _prefix_pair(text: str) -> tuple[str, str]:
    """``"bert.="`` -> ``("bert.", "")``."""
    old, sep, new = text.partition("=")
    if not sep or old == new:
        raise argparse.ArgumentTypeError(
            f"expected OLD=NEW with two different prefixes (NEW may be empty), got {text!r}"
        )
    return old, new


def _step_or_ref(text: str):
    """``"1200"`` -> 1200; anything else is a ref (branch or tag) name.  ``-1`` (Python's ``traj[-1]``) is
    refused with what to write instead: on the command line a step is its number (``rm URL -1`` deleting
    the newest step would be a surprise)."""
    if text.startswith("-") and text[1:].isdigit():
        raise argparse.ArgumentTypeError(
            f"{text}: a step here is its number (0 or more), not a position; the newest step of branch main "
            "is `main`, and `ulstore log URL` lists the step numbers"
        )
    return int(text) if text.isdigit() else text
