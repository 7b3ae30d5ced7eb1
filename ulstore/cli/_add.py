"""``ulstore add``: checkpoint files in as steps, with the checks and warnings that save a user a surprise."""

from __future__ import annotations

import warnings
from pathlib import Path

from ..core.formatting import human_bytes
from ._exit import EXIT_OK, UsageError
from ._opening import _checkpoints_at, _nbytes, _open, _storage_options
from ._steps import resolve

__all__ = ["_cmd_add"]


def _cmd_add(args, ui) -> int:
    from ..store import HEAD

    jobs = _jobs(args)
    traj, created, existed = _open_or_init(args)
    rows: list[dict] = []
    try:
        _refuse_existing(traj, jobs)
        parent = None if args.root else HEAD if args.parent is None else resolve(traj, args.url, args.parent).step
        rename = dict(args.rename_prefix or [])
        with ui.bar(total=len(jobs), desc="importing", unit="ckpt") as bar:
            for step, path in jobs:
                bar.set_postfix_str(Path(path).name)
                # the first derives from --parent (or the branch head), each next one from the one before
                this_parent = parent if not rows else rows[-1]["step"]
                rows.append(_add_one(traj, args, ui, step, path, this_parent, rename))
                bar.update(1)
                _say_added(ui, step, path, rows[-1])
    except BaseException:
        if created and not rows:
            _remove_new_trajectory(args, existed)  # a failed `add --init` leaves nothing behind
        raise
    ui.emit({"url": args.url, "added": rows})
    return EXIT_OK


def _jobs(args) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint named, by step; checked cheaply before the trajectory is created or written."""
    from .. import io as uio

    if args.step is not None and len(args.checkpoints) > 1:
        raise UsageError("--step applies to one CHECKPOINT; name the files by step to add several")
    jobs = []
    for path in args.checkpoints:
        uio.checkpoint_format(path)  # exists, known format
        step = args.step if args.step is not None else uio.step_from_path(path)
        if step is None:
            raise UsageError(f"{path}: cannot tell the step from the name; pass --step N")
        jobs.append((step, path))
    seen: dict[int, str] = {}
    for step, path in jobs:
        if step in seen:
            raise UsageError(f"{seen[step]} and {path} are both step {step}")
        seen[step] = path
    return sorted(jobs)


def _open_or_init(args) -> tuple[object, bool, bool]:
    """(the trajectory, whether this command created it, whether its directory existed before)."""
    from ..errors import NotFoundError

    try:
        return _open(args, "r+"), False, False
    except NotFoundError as e:
        if e.key != "zarr.json":  # not the root document missing: a missing bucket, say (its own words)
            raise
        found = _checkpoints_at(args.url)
        if found is not None:  # `ulstore add ckpts/*.safetensors`: the trajectory argument forgotten
            raise UsageError(
                f"{args.url!r} is {found[0]}, not a trajectory: add's first argument is the trajectory to add to "
                f"(`ulstore add --init runs/NAME {found[1]}`)"
            ) from None
        if not args.init:
            raise NotFoundError(
                f"no trajectory at {args.url!r} (create it with `ulstore init {args.url}` or pass --init)"
            ) from None
    existed = _exists(args)
    settings = {"anchor_every": args.anchor_every, "anchor_cost": args.anchor_cost, "chunk_bytes": args.chunk_bytes}
    return _open(args, "w-", **settings), True, existed


def _refuse_existing(traj, jobs: list[tuple[int, str]]) -> None:
    from ..errors import StepExistsError

    existing = set(traj.steps)
    for step, path in jobs:
        if step in existing:
            raise StepExistsError(
                f"{path}: step already exists; steps are immutable (`ulstore rm` it first)", step=step
            )


def _add_one(traj, args, ui, step: int, path, parent, rename: dict) -> dict:
    """Import one checkpoint as ``step`` and relay its warnings; returns its row."""
    from .. import io as uio

    moving_back = _moving_back(traj, args, step, parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", uio.FewSharedNamesWarning)
        uio.import_checkpoint(traj, path, step, parent=parent, branch=args.branch, rename_prefix=rename or None)
    for w in caught:
        _relay(ui, w.message, path)
    if moving_back:
        ui.warn(moving_back)
    return _row(traj, step, path)


def _say_added(ui, step: int, path, r: dict) -> None:
    ui.out(
        f"step {step:<8} <- {path}  ({r['format']}, {r['tensors']} tensors, {human_bytes(r['raw_bytes'])}, "
        f"parent {'-' if r['parent'] is None else r['parent']})"
    )
    if r["kept"]:
        ui.out(f"{'':13}{r['kept']}")


def _row(traj, step: int, path) -> dict:
    shapes = traj.tensors(step)
    info = traj.info(step)
    return {
        "step": step,
        "source": str(path),
        "parent": info.parent,
        "tensors": len(shapes),
        "raw_bytes": sum(_nbytes(shape, dtype) for shape, dtype in shapes.values()),
        "format": info.metadata["checkpoint"]["format"],
        "files": traj.files(step),
        "kept": _kept(info.metadata["checkpoint"]),
    }


def _kept(meta: dict) -> str:
    """What a directory brought besides weights: "kept 7 files (config.json, ...), optimizer state (12 tensors)"."""
    said = []
    files = meta.get("files") or []
    if files:
        shown = ", ".join(files[:4]) + (", ..." if len(files) > 4 else "")
        said.append(f"kept {len(files)} file{'s' if len(files) != 1 else ''} ({shown})")
    for name, entry in (meta.get("state") or {}).items():
        said.append(f"{name.rsplit('.', 1)[0].rsplit('/', 1)[-1]} state ({entry.get('tensors', 0)} tensors)")
    return ", ".join(said)


def _moving_back(traj, args, step: int, parent) -> str | None:
    """A step below its parent moves the branch back: what to say about it (after the commit), and how to avoid it."""
    from ..store import HEAD

    branch = args.branch or "main"
    head = traj.head(branch)
    parent_step = head if parent is HEAD else parent
    if parent_step is None or step >= parent_step or head != parent_step:
        return None
    below = [s for s in traj.steps if s < step]
    keep = f"--parent {below[-1]} --branch NAME" if below else "--root --branch NAME"
    return (
        f"step {step} is below its parent {parent_step}: branch {branch!r} moved back from {parent_step} to {step}. "
        f"To keep {branch!r} at {parent_step}, add older checkpoints on another branch ({keep}), "
        "or add checkpoints oldest first"
    )


def _relay(ui, warning, path) -> None:
    """A warning from the io layer, in the CLI's words."""
    from .. import io as uio

    if not isinstance(warning, uio.FewSharedNamesWarning):
        ui.warn(str(warning))
        return
    if warning.changed:  # a dtype or shape moved (the commit's words): which file
        ui.warn(f"{path}: {warning}")
        return
    text = (
        f"{path}: its tensor names match {warning.shared:.0%} of parent step {warning.parent}'s bytes, "
        "so the rest is stored whole instead of as a delta"
    )
    if warning.suggestion:
        ((old, new),) = warning.suggestion.items()
        text += (
            f"; `--rename-prefix {old}={new}` would match {warning.suggested_shared:.0%} "
            "(export gives the file's names back)"
        )
    else:
        text += "; if the tensors were renamed, pass --rename-prefix OLD=NEW"
    ui.warn(text)


def _exists(args) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(args.url, **(_storage_options(args) or {}))
    return bool(fs.exists(path))


def _remove_new_trajectory(args, existed: bool) -> None:
    """Remove the trajectory this command created (and the directory, unless it was there before)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(args.url, **(_storage_options(args) or {}))
    try:
        if existed:
            for child in fs.ls(path, detail=False):
                fs.rm(child, recursive=True)
        else:
            fs.rm(path, recursive=True)
    except OSError:
        pass  # best effort: the error that got us here is the one to report
