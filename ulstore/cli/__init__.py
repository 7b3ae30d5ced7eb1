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
>>> import contextlib, io, tempfile
>>> d = tempfile.mkdtemp()
>>> with contextlib.redirect_stdout(io.StringIO()) as out:
...     status = main(["init", f"{d}/traj", "--json"])
>>> status, json.loads(out.getvalue())["steps"]
(0, 0)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

from .core.formatting import binary_bytes, human_bytes, plural

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
PROG = "ulstore"
_ENV_OPTIONS = "ULSTORE_STORAGE_OPTIONS"

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


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ulstore`` (also renders ``docs/cli.md``).

    Examples
    --------
    >>> build_parser().parse_args(["log", "runs/a"]).command
    'log'
    """
    # Options every command takes; SUPPRESS keeps a sub-command from resetting
    # what was given before it (`ulstore --json log X` and `ulstore log X --json`).
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("output")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="print one JSON document on stdout instead of text")
    g.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="no progress bars, no messages on stderr")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of an error")
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("-o", "--storage-option", metavar="KEY=VALUE", action="append", default=[],
                       dest="storage_options",
                       help="fsspec filesystem option for remote URLs, e.g. -o endpoint_url=http://host:9000 "
                            "(repeatable; VALUE is parsed as JSON if it can be)")

    parser = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--json", action="store_true", default=False, help=argparse.SUPPRESS)
    parser.add_argument("-q", "--quiet", action="store_true", default=False, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", default=False, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True

    def command(name, help, description, examples, parents=(common, store)):
        p = sub.add_parser(name, help=help, description=f"{description}\n\nexamples:\n{examples}",
                           parents=list(parents), formatter_class=_Formatter)
        p.set_defaults(func=globals()[f"_cmd_{name}"])
        return p

    p = command("init", "create an empty trajectory",
                "Create an empty trajectory at URL (fails if one exists).",
                "  ulstore init runs/llama-ft\n  ulstore init s3://bucket/runs/llama-ft --anchor-every 32")
    p.add_argument("url", metavar="URL", help="where to create it: a local path or an fsspec URL")
    _settings_args(p)

    p = command("add", "import checkpoint files as new steps",
                "Import checkpoints as new steps, oldest step first.\n\n"
                "A CHECKPOINT is a .safetensors file, a Hugging Face model directory (sharded with\n"
                "model.safetensors.index.json, or one model.safetensors), a torch state dict\n"
                "(.pt/.pth/.bin, needs PyTorch) or an .npz.  The step comes from the name unless\n"
                "--step is given: step_001200.safetensors and checkpoint-1200/ are step 1200.\n"
                "Each step is committed atomically; file metadata and tied tensors are kept so\n"
                "that `ulstore export` gives the same tensors back.",
                "  ulstore add runs/a ckpts/step_*.safetensors\n"
                "  ulstore add runs/a out/checkpoint-1200/\n"
                "  ulstore add runs/a sft.pt --step 5000 --parent 1200 --branch sft")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("checkpoints", metavar="CHECKPOINT", nargs="+", help="checkpoint files or directories")
    p.add_argument("--step", type=_nonneg_int, metavar="N", help="step number (only with one CHECKPOINT)")
    parent = p.add_mutually_exclusive_group()
    parent.add_argument("--parent", metavar="S", type=_step_or_ref,
                        help="step or ref the first checkpoint derives from (default: the head of --branch)")
    parent.add_argument("--root", action="store_true", help="start a new chain: the first checkpoint has no parent")
    p.add_argument("--branch", metavar="B", help="branch to advance (default: main)")
    p.add_argument("--init", action="store_true", help="create the trajectory if it does not exist")
    _settings_args(p)

    p = command("log", "list steps, newest first",
                "List steps, newest first: parent, anchor distance, tensors, raw size, refs\n"
                "and the file each step was imported from.  With STEP (a step or a ref),\n"
                "only that step's ancestry.",
                "  ulstore log runs/a\n  ulstore log runs/a sft --json")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("start", metavar="STEP", nargs="?", type=_step_or_ref, help="show the ancestry of this step or ref")

    p = command("ls", "list the tensors of a step",
                "List the tensors of a step: name, dtype, shape, size (nothing is decoded).",
                "  ulstore ls runs/a 1200\n  ulstore ls runs/a main --json")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", type=_step_or_ref, help="a step or a ref (branch) name")

    p = command("export", "write a step as a checkpoint",
                "Write a step as a checkpoint; the format follows from OUT:\n"
                "  *.safetensors      one safetensors file (file metadata kept)\n"
                "  DIR/ or no suffix  a Hugging Face directory; sharded with --shard-size, or as\n"
                "                     the imported checkpoint was; else one model.safetensors\n"
                "  *.pt *.pth *.bin   a torch state dict (tied tensors share storage again)\n"
                "  *.npz              a numpy archive\n"
                "Tensor bytes are exactly the imported ones.  The output appears atomically.",
                "  ulstore export runs/a 1200 model.safetensors\n"
                "  ulstore export runs/a main out/checkpoint-1200 --shard-size 5GB\n"
                "  ulstore export runs/a 1200 state.pt")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", type=_step_or_ref, help="a step or a ref name")
    p.add_argument("out", metavar="OUT", help="output file or directory")
    p.add_argument("--shard-size", metavar="SIZE", help="shard limit, e.g. 5GB, 500MiB or a byte count")
    p.add_argument("--format", choices=["safetensors", "sharded", "torch", "npz"],
                   help="override the format chosen from OUT")
    p.add_argument("-f", "--force", action="store_true", help="replace OUT if it exists")

    p = command("verify", "re-read and check every blob and manifest",
                "Re-read every blob and manifest reachable from STEP (default: all steps and refs),\n"
                "check each against its hash, decode it and check the result.  Exit status 1 if\n"
                "anything is damaged.",
                "  ulstore verify runs/a\n  ulstore verify runs/a 1200")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", nargs="?", type=_step_or_ref, help="only this step (and its references)")

    p = command("stats", "raw vs stored size, per step and per tensor",
                "Raw size (the tensors as stored in a checkpoint) against stored size (new blobs +\n"
                "manifest), per step and per tensor, in bytes and bits per weight.  A blob is\n"
                "charged to the first step that uses it.  --plot draws the per-step sizes\n"
                "(needs matplotlib: pip install 'ulstore[plot]').",
                "  ulstore stats runs/a\n  ulstore stats runs/a --plot sizes.png --top 5")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("--plot", metavar="FILE.png", help="also draw stored vs raw size per step to this PNG")
    p.add_argument("--top", metavar="N", type=_nonneg_int, default=15,
                   help="tensors to list, largest stored first (default 15; 0: all)")

    p = command("gc", "remove blobs no step uses",
                "Remove blobs that no step manifest references (left by `ulstore rm` or by a\n"
                "crashed commit).  While another process may be committing, pass\n"
                "--older-than a bound on how long a commit takes.",
                "  ulstore gc runs/a\n  ulstore gc s3://bucket/runs/a --older-than 3600")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("--older-than", metavar="SECONDS", type=float, default=0.0,
                   help="only remove blobs at least this old (default 0)")

    p = command("rm", "delete a step",
                "Delete a step; every other step stays readable, exactly (chunks coded against it\n"
                "are re-encoded, its children re-parented, refs on it moved to its parent).\n"
                "Then run `ulstore gc URL` to free its blobs.",
                "  ulstore rm runs/a 1200")
    p.add_argument("url", metavar="URL", help="the trajectory")
    p.add_argument("step", metavar="STEP", type=_step_or_ref, help="the step to delete")

    p = command("demo", "train a small model on this CPU, store every step, show sizes",
                "Train a small language model for real on the CPU (under a minute), store a bf16\n"
                "checkpoint after every step, print the size against raw safetensors and zstd,\n"
                "read a slice of an old step back lazily, verify, and say where the data lives.\n"
                "DIR defaults to ./ulstore-demo; an earlier demo there is replaced.",
                "  ulstore demo\n  ulstore demo /tmp/demo --steps 20 --preset tiny", parents=(common,))
    p.add_argument("dir", metavar="DIR", nargs="?", default=None, help="where to store the trajectory")
    p.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                   help="optimizer steps to train and store (default 60)")
    p.add_argument("--preset", choices=["tiny", "small", "bench"], default=None,
                   help="model size: tiny ~54K, small ~1.8M (default), bench ~13M parameters")
    return parser


def _settings_args(p) -> None:
    p.add_argument("--anchor-every", metavar="N", type=_nonneg_int,
                   help="a full anchor every N steps along a chain (new trajectories; default 16)")
    p.add_argument("--chunk-bytes", metavar="N", type=_positive_int,
                   help="target chunk size in bytes for new tensors (new trajectories; default 4 MiB)")


def _version() -> str:
    from . import __version__

    return __version__


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


def _step_or_ref(text: str):
    """``"1200"`` -> 1200; anything else is a ref (branch or tag) name."""
    return int(text) if text.isdigit() else text


# ---------------------------------------------------------------------- running


class _UI:
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


def main(argv=None) -> int:
    """Run ``ulstore`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) and usage errors (2)
        return int(e.code or 0)
    ui = _UI(args)
    try:
        return args.func(args, ui) or EXIT_OK
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ulstore log X | head`
        _silence_stdout()
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 -- the one place that turns errors into a message
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug or _expected(e) else " (unexpected; rerun with --debug for the traceback)"
        print(f"{PROG}: error: {_describe(e)}{hint}", file=sys.stderr)
        return EXIT_ERROR


def _expected(e: BaseException) -> bool:
    from .errors import UlstoreError

    return isinstance(e, (UlstoreError, OSError, ValueError)) or type(e).__module__.split(".")[0] in (
        "botocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "fsspec")


def _describe(e: BaseException) -> str:
    from .errors import UlstoreError

    text = str(e).strip()
    if isinstance(e, FileNotFoundError) and not isinstance(e, UlstoreError) and e.filename:
        text = f"{e.filename}: no such file or directory"
    elif isinstance(e, PermissionError) and not isinstance(e, UlstoreError) and e.filename:
        text = f"{e.filename}: permission denied"
    elif not isinstance(e, UlstoreError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return " ".join(text.split()) or type(e).__name__  # one line


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


def _storage_options(args) -> dict | None:
    options = {}
    env = os.environ.get(_ENV_OPTIONS)
    if env:
        try:
            options = json.loads(env)
        except ValueError as e:
            raise _usage_error(f"{_ENV_OPTIONS} is not JSON: {e}") from None
        if not isinstance(options, dict):
            raise _usage_error(f"{_ENV_OPTIONS} must be a JSON object")
    for item in getattr(args, "storage_options", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _usage_error(f"-o expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


def _usage_error(message: str):
    from .errors import InvalidInputError

    return InvalidInputError(message)


def _open(args, mode: str, **settings):
    from .store import open as open_trajectory

    settings = {k: v for k, v in settings.items() if v is not None}
    return open_trajectory(args.url, mode=mode, storage_options=_storage_options(args), **settings)


def _open_existing(args, mode: str = "r"):
    from .errors import NotFoundError

    try:
        return _open(args, mode)
    except NotFoundError:
        raise NotFoundError(f"no trajectory at {args.url!r} (create one with `ulstore init {args.url}`)") from None


def _table(rows: list[list], headers: list[str], align: str) -> list[str]:
    """Plain text columns; ``align`` has one of ``<`` / ``>`` per column."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)]
        lines.append("  ".join(parts).rstrip())
    return lines


# --------------------------------------------------------------------- commands


def _cmd_init(args, ui) -> int:
    traj = _open(args, "w-", anchor_every=args.anchor_every, chunk_bytes=args.chunk_bytes)
    doc = {"url": args.url, "anchor_every": traj.anchor_every, "chunk_bytes": traj.chunk_bytes, "steps": 0}
    ui.emit(doc)
    ui.out(f"initialized an empty trajectory at {args.url} "
           f"(an anchor every {traj.anchor_every} steps, {binary_bytes(traj.chunk_bytes)} chunks)")
    return EXIT_OK


def _cmd_add(args, ui) -> int:
    from . import io as uio
    from .errors import InvalidInputError, NotFoundError, StepExistsError
    from .store import HEAD

    if args.step is not None and len(args.checkpoints) > 1:
        raise InvalidInputError("--step applies to one CHECKPOINT; name the files by step to add several")
    if args.init:
        traj = _open(args, "a", anchor_every=args.anchor_every, chunk_bytes=args.chunk_bytes)
    else:
        try:
            traj = _open(args, "r+")
        except NotFoundError:
            raise NotFoundError(f"no trajectory at {args.url!r} (create it with `ulstore init {args.url}` "
                                "or pass --init)") from None
    # Check everything that can be checked cheaply before the first commit.
    jobs = []
    for path in args.checkpoints:
        uio.checkpoint_format(path)  # exists, known format
        step = args.step if args.step is not None else uio.step_from_path(path)
        if step is None:
            raise InvalidInputError(f"{path}: cannot tell the step from the name; pass --step N")
        jobs.append((step, path))
    seen = {}
    for step, path in jobs:
        if step in seen:
            raise InvalidInputError(f"{seen[step]} and {path} are both step {step}")
        seen[step] = path
    existing = set(traj.steps)
    for step, path in jobs:
        if step in existing:
            raise StepExistsError(f"{path}: step already exists; steps are immutable (`ulstore rm` it first)",
                                  step=step)
    jobs.sort()
    parent = None if args.root else (args.parent if args.parent is not None else HEAD)
    rows = []
    with ui.bar(total=len(jobs), desc="importing", unit="ckpt") as bar:
        for step, path in jobs:
            bar.set_postfix_str(Path(path).name)
            # the first derives from --parent (or the branch head), each next one from the one before
            uio.import_checkpoint(traj, path, step, parent=parent if not rows else rows[-1]["step"],
                                  branch=args.branch)
            shapes = traj.tensors(step)
            info = traj.info(step)
            row = {"step": step, "source": str(path), "parent": info.parent, "tensors": len(shapes),
                   "raw_bytes": sum(_nbytes(shape, dtype) for shape, dtype in shapes.values()),
                   "format": info.metadata["checkpoint"]["format"]}
            rows.append(row)
            bar.update(1)
            ui.out(f"step {step:<8} <- {path}  ({row['format']}, {len(shapes)} tensors, {human_bytes(row['raw_bytes'])}, "
                   f"parent {'-' if info.parent is None else info.parent})")
    ui.emit({"url": args.url, "added": rows})
    return EXIT_OK


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def _cmd_log(args, ui) -> int:
    traj = _open_existing(args)
    refs_by_step: dict[int, list[str]] = {}
    for name, step in sorted(traj.refs.items()):
        refs_by_step.setdefault(step, []).append(name)
    if args.start is not None:
        infos = traj.log(args.start)
    else:
        infos = [traj.info(s) for s in reversed(traj.steps)]
    rows, docs = [], []
    for info in infos:
        shapes = traj.tensors(info.step)
        raw = sum(_nbytes(shape, dtype) for shape, dtype in shapes.values())
        meta = dict(info.metadata)
        ck = meta.pop("checkpoint", None) or {}
        doc = {"step": info.step, "parent": info.parent, "anchor_distance": info.anchor_distance,
               "tensors": len(shapes), "raw_bytes": raw, "created": info.created,
               "refs": refs_by_step.get(info.step, []), "source": ck.get("source"), "metadata": meta}
        docs.append(doc)
        rows.append([info.step, "-" if info.parent is None else info.parent,
                     "anchor" if info.anchor_distance == 0 else f"+{info.anchor_distance}", len(shapes),
                     human_bytes(raw), info.created.replace("+00:00", "Z"), ",".join(doc["refs"]),
                     ck.get("source") or _short_meta(meta)])
    ui.emit({"url": args.url, "steps": docs})
    if not rows:
        ui.out(f"{args.url}: no steps yet (add some with `ulstore add {args.url} CHECKPOINT...`)")
        return EXIT_OK
    for line in _table(rows, ["step", "parent", "anchor", "tensors", "raw", "created", "refs", "details"],
                       ">>>>><<<<"):
        ui.out(line)
    return EXIT_OK


def _short_meta(meta: dict) -> str:
    text = " ".join(f"{k}={v}" for k, v in meta.items() if not isinstance(v, (dict, list)))
    return text if len(text) <= 60 else text[:57] + "..."


def _cmd_ls(args, ui) -> int:
    traj = _open_existing(args)
    info = traj.info(args.step)
    shapes = traj.tensors(info.step)
    aliases = (info.metadata.get("checkpoint") or {}).get("aliases") or {}
    rows, docs, total, elements = [], [], 0, 0
    for name, (shape, dtype) in shapes.items():
        n = _nbytes(shape, dtype)
        total += n
        elements += n // dtype.itemsize
        docs.append({"name": name, "dtype": dtype.name, "shape": list(shape), "bytes": n})
        rows.append([name, dtype.name, "x".join(map(str, shape)) or "scalar", human_bytes(n)])
    for alias, canon in aliases.items():
        shape, dtype = shapes[canon]
        docs.append({"name": alias, "dtype": dtype.name, "shape": list(shape), "bytes": 0, "alias_of": canon})
        rows.append([alias, dtype.name, "x".join(map(str, shape)) or "scalar", f"= {canon}"])
    ui.emit({"url": args.url, "step": info.step, "tensors": docs, "raw_bytes": total, "elements": elements})
    for line in _table(rows, ["name", "dtype", "shape", "size"], "<<>>"):
        ui.out(line)
    ui.out(f"{len(shapes)} tensors{f' (+{len(aliases)} tied)' if aliases else ''}, {elements:,} elements, "
           f"{human_bytes(total)} (step {info.step})")
    return EXIT_OK


def _cmd_export(args, ui) -> int:
    from . import io as uio

    traj = _open_existing(args)
    step = traj.info(args.step).step
    raw = sum(_nbytes(shape, dtype) for shape, dtype in traj.tensors(step).values())
    with ui.bar(total=raw, desc=f"reading step {step}", unit="B", unit_scale=True) as bar:
        result = uio.export_checkpoint(traj, step, args.out, format=args.format, max_shard_size=args.shard_size,
                                       overwrite=args.force, progress=bar.update if ui.progress else None)
    result = {"url": args.url, "step": step, **result}
    result["tensors"] = len(result["tensors"])
    ui.emit(result)
    n_files = len(result["files"])
    ui.out(f"wrote step {step} to {args.out} ({result['format']}, {result['tensors']} tensors, "
           f"{human_bytes(result['bytes'])}{f', {n_files} files' if n_files > 1 else ''})")
    return EXIT_OK


def _cmd_verify(args, ui) -> int:
    traj = _open_existing(args)
    if ui.progress:
        ui.note(f"verifying {'step ' + str(args.step) if args.step is not None else f'{len(traj.steps)} steps'} ...")
    report = traj.verify(args.step, raise_on_error=False)
    ui.emit({"url": args.url, "ok": report.ok, "steps": report.steps, "chunks": report.chunks,
             "blobs": report.blobs, "errors": report.errors})
    if report.ok:
        ui.out(f"OK: {plural(report.steps, 'step')}, {plural(report.chunks, 'chunk')}, {plural(report.blobs, 'blob')} "
               "re-read and checked")
        return EXIT_OK
    ui.out(f"DAMAGED: {plural(len(report.errors), 'object')} failed their checks "
           f"({plural(report.steps, 'step')}, {plural(report.chunks, 'chunk')}, {plural(report.blobs, 'blob')} examined)")
    for e in report.errors:
        where = ", ".join(f"{k} {e[k]}" for k in ("step", "tensor") if e.get(k) is not None)
        ui.out(f"  {e.get('key') or '-'}: {e['error']}: {e['message']}{f' ({where})' if where else ''}")
    if ui.json:
        print(f"{PROG}: error: verify found {len(report.errors)} damaged object(s)", file=sys.stderr)
    return EXIT_ERROR


def _cmd_stats(args, ui) -> int:
    from . import io as uio

    traj = _open_existing(args)
    if args.plot:
        _check_matplotlib()
    report = uio.storage_report(traj)
    total = report["total"]
    if args.plot:
        _plot(report, args.plot, args.url)
    ui.emit({"url": args.url, **report, "plot": args.plot})
    if not report["steps"]:
        ui.out(f"{args.url}: no steps yet")
        return EXIT_OK
    ui.out(f"{args.url}: {total['steps']} steps, {total['elements']:,} weights in all")
    ui.out(f"  raw {human_bytes(total['raw_bytes'])}, stored {human_bytes(total['stored_bytes'])} "
           f"(ratio {_ratio(total)}, {total['bits_per_weight']:.2f} bits/weight; manifests "
           f"{human_bytes(total['manifest_bytes'])})" + (f"; unreferenced blobs {human_bytes(total['unreferenced_bytes'])}"
                                                    f" (`ulstore gc`)" if total["unreferenced_bytes"] else ""))
    ui.out("")
    ui.out("per step:")
    rows = [[r["step"], "-" if r["parent"] is None else r["parent"], human_bytes(r["raw_bytes"]),
             human_bytes(r["stored_bytes"]), _ratio(r), f"{r['bits_per_weight']:.2f}", r["new_blobs"], r["chunks"]]
            for r in report["steps"]]
    for line in _table(rows, ["step", "parent", "raw", "stored", "ratio", "bits/w", "new blobs", "chunks"],
                       ">>>>>>>>"):
        ui.out("  " + line)
    ui.out("")
    tensors = report["tensors"] if not args.top else report["tensors"][: args.top]
    ui.out("per tensor (all steps, largest stored first):")
    rows = [[r["name"], r["dtype"], human_bytes(r["raw_bytes"]), human_bytes(r["stored_bytes"]), _ratio(r),
             f"{r['bits_per_weight']:.2f}"] for r in tensors]
    for line in _table(rows, ["tensor", "dtype", "raw", "stored", "ratio", "bits/w"], "<<>>>>"):
        ui.out("  " + line)
    if len(tensors) < len(report["tensors"]):
        ui.out(f"  ... {len(report['tensors']) - len(tensors)} more (--top 0 lists all)")
    if args.plot:
        ui.out("")
        ui.out(f"plot written to {args.plot}")
    return EXIT_OK


def _ratio(row) -> str:
    return f"{row['ratio']:.1f}x" if row.get("ratio") else "-"


def _check_matplotlib() -> None:
    from .errors import InvalidInputError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InvalidInputError("--plot needs matplotlib, which is not installed: pip install 'ulstore[plot]'") from None


def _plot(report: dict, out: str, url: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in report["steps"]]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(steps, [r["raw_bytes"] / 1e6 for r in report["steps"]], "o-", ms=3, label="raw (checkpoint)")
    ax.plot(steps, [r["stored_bytes"] / 1e6 for r in report["steps"]], "o-", ms=3, label="stored (new blobs + manifest)")
    ax.set_ylabel("MB per step")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"ulstore stats: {url}")
    bx.plot(steps, [r["bits_per_weight"] for r in report["steps"]], "o-", ms=3, color="C2")
    bx.set_ylabel("bits / weight")
    bx.set_xlabel("step")
    bx.set_ylim(bottom=0)
    fig.tight_layout()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.parent / f".{out_path.name}.tmp.png"
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out_path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()


def _cmd_gc(args, ui) -> int:
    traj = _open_existing(args, "r+")
    result = traj.gc(older_than=args.older_than)
    ui.emit({"url": args.url, **result})
    ui.out(f"removed {plural(result['blobs'], 'unreferenced blob')}, {human_bytes(result['bytes'])}")
    return EXIT_OK


def _cmd_rm(args, ui) -> int:
    traj = _open_existing(args, "r+")
    info = traj.info(args.step)
    moved = [name for name, step in traj.refs.items() if step == info.step]
    traj.delete(info.step)
    ui.emit({"url": args.url, "deleted": info.step, "parent": info.parent, "refs_moved": moved})
    ui.out(f"deleted step {info.step}" + (f"; moved {', '.join(moved)} to {info.parent}" if moved and
                                         info.parent is not None else "")
           + f"; run `ulstore gc {args.url}` to free its blobs")
    return EXIT_OK


def _cmd_demo(args, ui) -> int:
    from . import demo

    kwargs = {k: v for k, v in (("steps", args.steps), ("preset", args.preset)) if v is not None}
    summary = demo.run(args.dir or demo.DEFAULT_DIR, echo=ui.out, progress=ui.progress, **kwargs)
    ui.emit(summary)
    return EXIT_OK if summary["slice_equal"] and summary["verified"] else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
