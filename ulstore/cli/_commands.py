"""What each ``ulstore`` command does: ``_cmd_<name>(args, ui) -> exit status``."""

from __future__ import annotations

from ..core.formatting import binary_bytes, human_bytes, plural
from ..errors import IntegrityError, InvalidInputError
from ._add import _cmd_add
from ._exit import EXIT_ERROR, EXIT_OK, UsageError
from ._opening import _checkpoints_at, _nbytes, _open, _open_existing, _storage_options
from ._plot import check_matplotlib, plot_diff, plot_report
from ._steps import resolve
from ._ui import report_error, table

__all__ = ["_cmd_add"]


def _cmd_init(args, ui) -> int:
    found = _checkpoints_at(args.url)
    if found is not None:  # `ulstore init ckpts/`: the trajectory would land among the checkpoints it should hold
        raise UsageError(
            f"{args.url!r} is {found[0]}: a trajectory goes in a directory of its own "
            f"(`ulstore init runs/NAME`, then `ulstore add runs/NAME {found[1]}`; or both: "
            f"`ulstore add --init runs/NAME {found[1]}`)"
        )
    traj = _open(args, "w-", anchor_every=args.anchor_every, anchor_cost=args.anchor_cost, chunk_bytes=args.chunk_bytes)
    doc = {
        "url": args.url,
        "anchor_every": traj.anchor_every,
        "anchor_cost": traj.anchor_cost,
        "chunk_bytes": traj.chunk_bytes,
        "steps": 0,
    }
    ui.emit(doc)
    policy = (
        f"an anchor every {traj.anchor_every} steps"
        if traj.anchor_cost is None
        else f"an anchor when reading the next step would cost more than {traj.anchor_cost:g}x reading an anchor"
    )
    ui.out(f"initialized an empty trajectory at {args.url} ({policy}, {binary_bytes(traj.chunk_bytes)} chunks)")
    return EXIT_OK


def _anchor_column(info) -> str:
    """``log``'s anchor column: an anchor and why (``anchor: cost 2.3x>2``, ``anchor: every 16``, ``anchor: root``,
    ``anchor: asked``), or the distance to the chain's anchor and, under the cost model, the read's cost in
    anchor reads (``+3 1.4x``)."""
    a = info.anchoring
    if info.anchor_distance > 0:
        ratio = f" {a['cost'] / a['anchor_cost']:.1f}x" if a is not None and a["anchor_cost"] else ""
        return f"+{info.anchor_distance}{ratio}"
    why = (a or {}).get("anchor")
    if not why:
        return "anchor"
    policy = why["policy"]
    if policy == "cost":
        return f"anchor: cost {why['predicted'] / max(why['limit'] / why['k'], 1):.1f}x>{why['k']:g}"
    if policy == "every":
        return f"anchor: every {why['every']}"
    return f"anchor: {policy}"


def _cmd_log(args, ui) -> int:
    from .. import io as uio

    traj = _open_existing(args)
    refs_by_step: dict[int, list[str]] = {}
    for name, step in sorted(traj.refs.items()):
        refs_by_step.setdefault(step, []).append(name)
    ancestry = traj.log(resolve(traj, args.url, args.start).step) if args.start is not None else None
    newest = ancestry if ancestry is not None else traj.steps[::-1]
    shown = newest[: args.max_count or None]  # -n N: the N newest
    infos = shown if ancestry is not None else [traj.info(s) for s in shown]
    # (every step's, not only those shown: a step's stored bytes are what no earlier step's tables name)
    with ui.activity(f"reading {plural(len(traj.steps), 'step manifest')} for sizes"):
        # what each step added: its new blobs, step document and table blocks (as `ulstore stats`)
        stored = {r["step"]: r["stored_bytes"] for r in uio.storage_report(traj)["steps"]} if infos else {}
    rows, docs = [], []
    for info in infos:
        shapes = traj.tensors(info.step)
        raw = sum(_nbytes(shape, dtype) for shape, dtype in shapes.values())
        meta = dict(info.metadata)
        ck = meta.pop("checkpoint", None) or {}
        doc = {
            "step": info.step,
            "parent": info.parent,
            "anchor_distance": info.anchor_distance,
            "anchoring": info.anchoring,
            "tensors": len(shapes),
            "raw_bytes": raw,
            "stored_bytes": stored.get(info.step, 0),
            "created": info.created,
            "refs": refs_by_step.get(info.step, []),
            "source": ck.get("source"),
            "metadata": meta,
        }
        docs.append(doc)
        rows.append(
            [
                info.step,
                "-" if info.parent is None else info.parent,
                _anchor_column(info),
                len(shapes),
                human_bytes(raw),
                human_bytes(doc["stored_bytes"]),
                info.created.replace("+00:00", "Z"),
                ",".join(doc["refs"]),
                ck.get("source") or _short_meta(meta),
            ]
        )
    total = {
        "steps": len(docs),
        "raw_bytes": sum(d["raw_bytes"] for d in docs),
        "stored_bytes": sum(d["stored_bytes"] for d in docs),
    }
    ui.emit({"url": args.url, "steps": docs, "total": total, "not_listed": len(newest) - len(shown)})
    if not rows:
        ui.out(f"{args.url}: no steps yet (add some with `ulstore add {args.url} CHECKPOINT...`)")
        return EXIT_OK
    headers = ["step", "parent", "anchor", "tensors", "raw", "stored", "created", "refs", "details"]
    for line in table(rows, headers, ">>>>>><<<"):
        ui.out(line)
    if len(newest) > len(shown):
        ui.out(f"... and {plural(len(newest) - len(shown), 'older step')} (-n {len(shown)}; without -n, all)")
    ratio = f" ({total['raw_bytes'] / total['stored_bytes']:.1f}x)" if total["stored_bytes"] else ""
    ui.out(
        f"{plural(total['steps'], 'step')}: raw {human_bytes(total['raw_bytes'])}, "
        f"stored {human_bytes(total['stored_bytes'])}{ratio}"
    )
    return EXIT_OK


def _short_meta(meta: dict) -> str:
    text = " ".join(f"{k}={v}" for k, v in meta.items() if not isinstance(v, (dict, list)))
    return text if len(text) <= 60 else text[:57] + "..."


def _cmd_ls(args, ui) -> int:
    traj = _open_existing(args)
    info = resolve(traj, args.url, args.step)
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
        # the tie in the name column: as the size cell it widened that right-aligned column for every row
        rows.append([f"{alias} (= {canon})", dtype.name, "x".join(map(str, shape)) or "scalar", "tied"])
    files = {name: f.size for name, f in sorted(traj._reader.doc(info.step).files.items())}
    ui.emit(
        {
            "url": args.url,
            "step": info.step,
            "tensors": docs,
            "raw_bytes": total,
            "elements": elements,
            "files": [{"name": n, "bytes": b} for n, b in files.items()],
        }
    )
    for line in table(rows, ["name", "dtype", "shape", "size"], "<<>>"):
        ui.out(line)
    ui.out(
        f"{len(shapes)} tensors{f' (+{len(aliases)} tied)' if aliases else ''}, {elements:,} elements, "
        f"{human_bytes(total)} (step {info.step})"
    )
    if files:
        ui.out("")
        for line in table([[n, human_bytes(b)] for n, b in files.items()], ["file", "size"], "<>"):
            ui.out(line)
        ui.out(f"{len(files)} file{'s' if len(files) != 1 else ''}, {human_bytes(sum(files.values()))}")
    return EXIT_OK


def _cmd_export(args, ui) -> int:
    from .. import io as uio

    try:  # a bad OUT suffix or shard size is a usage error (exit 2), found before anything is read
        uio.output_format(args.out, format=args.format, max_shard_size=args.shard_size)
        if args.shard_size is not None:
            uio.checkpoints.parse_size(args.shard_size)
    except InvalidInputError as e:
        raise UsageError(e.message) from None
    traj = _open_existing(args)
    step = resolve(traj, args.url, args.step).step
    weights = {n: v for n, v in traj.tensors(step).items() if not uio.is_state_tensor(n)}
    raw = sum(_nbytes(shape, dtype) for shape, dtype in weights.values())
    with ui.bar(total=raw, desc=f"reading step {step}", unit="B", unit_scale=True) as bar:
        result = uio.export_checkpoint(
            traj,
            step,
            args.out,
            format=args.format,
            max_shard_size=args.shard_size,
            overwrite=args.force,
            progress=bar.update if ui.progress else None,
        )
    result = {"url": args.url, "step": step, **result}
    result["tensors"] = len(result["tensors"])
    ui.emit(result)
    n_files = len(result["files"])
    kind = "Hugging Face directory" if result["format"] == "sharded" else result["format"]  # (one shard or more)
    ui.out(
        f"wrote step {step} to {args.out} ({kind}, {result['tensors']} tensors, "
        f"{human_bytes(result['bytes'])}{f', {n_files} files' if n_files > 1 else ''})"
    )
    return EXIT_OK


def _warnings(report, ui) -> None:
    """A verify report's warnings (derived fields of step documents that disagree: the data reads exactly)."""
    for w in report.warnings:
        ui.out(f"  warning: {w['key']}: {w['error']}: {w['message']}")


def _cmd_verify(args, ui) -> int:
    traj = _open_existing(args)
    step = resolve(traj, args.url, args.step).step if args.step is not None else None
    what = f"step {step}" if step is not None else plural(len(traj.steps), "step")
    with ui.activity(f"verifying {what}: re-reading and decoding every blob"):
        report = traj.verify(step, raise_on_error=False)
    ui.emit(
        {
            "url": args.url,
            "ok": report.ok,
            "steps": report.steps,
            "chunks": report.chunks,
            "blobs": report.blobs,
            "errors": report.errors,
            "warnings": report.warnings,
        }
    )
    if report.ok:
        ui.out(
            f"OK: {plural(report.steps, 'step')}, {plural(report.chunks, 'chunk')}, {plural(report.blobs, 'blob')} "
            "re-read and checked" + (f"; {plural(len(report.warnings), 'warning')}" if report.warnings else "")
        )
        _warnings(report, ui)
        return EXIT_OK
    ui.out(
        f"DAMAGED: {plural(len(report.errors), 'object')} failed the checks "
        f"({plural(report.steps, 'step')}, {plural(report.chunks, 'chunk')}, {plural(report.blobs, 'blob')} examined)"
    )
    for e in report.errors:
        where = ", ".join(f"{k} {e[k]}" for k in ("step", "tensor") if e.get(k) is not None)
        ui.out(f"  {e.get('key') or '-'}: {e['error']}: {e['message']}{f' ({where})' if where else ''}")
    _warnings(report, ui)
    if ui.json:
        first = report.errors[0]
        report_error(
            True,
            _damaged(first),
            EXIT_ERROR,
            f"verify found {plural(len(report.errors), 'damaged object')}: "
            + "; ".join(f"{e.get('key') or '-'}: {e['error']}" for e in report.errors),
        )
    return EXIT_ERROR


def _damaged(error: dict) -> IntegrityError:
    """What ``verify --json`` reports on stderr: the first damaged object's error class (a public one, as
    ``Trajectory.verify`` raises it), step, tensor and key."""
    from .. import errors

    cls = getattr(errors, error.get("error") or "", None)
    if not (isinstance(cls, type) and issubclass(cls, IntegrityError) and cls.__name__ in errors.__all__):
        cls = IntegrityError
    e = cls(error.get("message", ""))
    e.step, e.tensor, e.key = error.get("step"), error.get("tensor"), error.get("key")
    return e


def _cmd_stats(args, ui) -> int:
    from .. import io as uio

    traj = _open_existing(args)
    if args.plot:
        check_matplotlib()
    with ui.activity(f"reading {plural(len(traj.steps), 'step manifest')} and listing blobs"):
        report = uio.storage_report(traj)
    total = report["total"]
    if args.plot:
        plot_report(report, args.plot, args.url)
    ui.emit({"url": args.url, **report, "plot": args.plot})
    if not report["steps"]:
        ui.out(f"{args.url}: no steps yet")
        return EXIT_OK
    ui.out(f"{args.url}: {total['steps']} steps, {total['elements']:,} weights in all")
    ui.out(
        f"  raw {human_bytes(total['raw_bytes'])}, stored {human_bytes(total['stored_bytes'])} "
        f"(ratio {_ratio(total)}, {total['bits_per_weight']:.2f} bits/weight; manifests "
        f"{human_bytes(total['manifest_bytes'])})"
        + (
            f"; unreferenced blobs {human_bytes(total['unreferenced_bytes'])} (`ulstore gc`)"
            if total["unreferenced_bytes"]
            else ""
        )
    )
    ui.out("")
    ui.out("per step:")
    rows = [
        [
            r["step"],
            "-" if r["parent"] is None else r["parent"],
            human_bytes(r["raw_bytes"]),
            human_bytes(r["stored_bytes"]),
            _ratio(r),
            f"{r['bits_per_weight']:.2f}",
            r["new_blobs"],
            r["chunks"],
        ]
        for r in report["steps"]
    ]
    headers = ["step", "parent", "raw", "stored", "ratio", "bits/w", "new blobs", "chunks"]
    if total["resharded_chunks"]:  # a distributed save changed sharding: say what its chunks were coded against
        headers.append("resharded")
        for row, r in zip(rows, report["steps"]):
            row.append(r["resharded_chunks"])
    for line in table(rows, headers, ">" * len(headers)):
        ui.out("  " + line)
    if total["resharded_chunks"]:
        ui.out(
            "  (resharded: chunks coded against their parent's values over the same box, "
            "assembled from the parent's other pieces)"
        )
    ui.out("")
    tensors = report["tensors"] if not args.top else report["tensors"][: args.top]
    ui.out("per tensor (all steps, largest stored first):")
    rows = [
        [
            r["name"],
            r["dtype"],
            human_bytes(r["raw_bytes"]),
            human_bytes(r["stored_bytes"]),
            _ratio(r),
            f"{r['bits_per_weight']:.2f}",
        ]
        for r in tensors
    ]
    for line in table(rows, ["tensor", "dtype", "raw", "stored", "ratio", "bits/w"], "<<>>>>"):
        ui.out("  " + line)
    if len(tensors) < len(report["tensors"]):
        ui.out(f"  ... {len(report['tensors']) - len(tensors)} more (--top 0 lists all)")
    if args.plot:
        ui.out("")
        ui.out(f"plot written to {args.plot}")
    return EXIT_OK


def _ratio(row) -> str:
    return f"{row['ratio']:.1f}x" if row.get("ratio") else "-"


def _cmd_diff(args, ui) -> int:
    traj = _open_existing(args)
    a, b = resolve(traj, args.url, args.a).step, resolve(traj, args.url, args.b).step
    if args.plot:
        check_matplotlib()
        path = _ancestry_between(traj, args.url, a, b)
    with ui.activity(f"comparing step {b} with step {a}"):
        diffs = traj.diff(a, b)
    docs = [_finite(d.to_dict()) for d in diffs]
    total = _diff_total(diffs)
    if args.plot:
        _plot_path(traj, ui, path, args.plot, f"ulstore diff {args.url} {a}..{b}", args.metric)
    ui.emit({"url": args.url, "a": a, "b": b, "tensors": docs, "total": total, "plot": args.plot})
    rows = [_diff_row(d) for d in (diffs if not args.top else diffs[: args.top])]
    for line in table(rows, ["tensor", "dtype", "shape", "changed", "rel L2", "max |change|", "nonfinite"], "<<>>>>>"):
        ui.out(line)
    if args.top and len(diffs) > args.top:
        ui.out(f"... {len(diffs) - args.top} more (--top 0 lists all)")
    share = f" ({100 * total['changed'] / total['elements']:.2f}%)" if total["elements"] else ""
    elements = f", {total['changed']:,} of {total['elements']:,} elements{share}" if total["elements"] else ""
    kinds = [
        f"{n} {what}"
        for status, what in (("added", "added"), ("removed", "removed"), ("reshaped", "of another dtype or shape"))
        if (n := sum(1 for d in diffs if d.status == status))
    ]
    whole = f" ({', '.join(kinds)}: not compared element by element)" if kinds else ""
    ui.out(
        f"step {b} against step {a}: {total['tensors_changed']} of {plural(total['tensors'], 'tensor')} changed"
        f"{elements}{whole}"
    )
    if args.plot:
        ui.out(f"plot of {plural(len(path) - 1, 'step')} written to {args.plot}")
    return EXIT_OK


def _diff_total(diffs) -> dict:
    """Tensors and elements compared, and how many of them changed."""
    compared = [d for d in diffs if d.status == "compared"]
    return {
        "tensors": len(diffs),
        "tensors_changed": sum(1 for d in diffs if d.changed),
        "elements": sum(d.elements for d in compared),
        "changed": sum(d.changed for d in compared),
    }


def _diff_row(d) -> list:
    """One tensor's line of the diff table."""
    shape = "x".join(map(str, d.shape)) or "scalar"
    was_shape = None if d.shape_a is None else "x".join(map(str, d.shape_a)) or "scalar"
    return [
        d.name,
        d.dtype if d.dtype_a in (None, d.dtype) else f"{d.dtype_a}->{d.dtype}",  # a reshaped tensor: from -> to
        shape if was_shape in (None, shape) else f"{was_shape}->{shape}",
        f"{100 * d.fraction_changed:.2f}%" if d.status == "compared" else _status_word(d),
        "-" if d.rel_l2 is None else f"{d.rel_l2:.3g}",
        "-" if d.max_abs_change is None else f"{d.max_abs_change:.3g}",
        d.nonfinite or "",
    ]


def _status_word(d) -> str:
    """The changed column of a tensor not compared element by element: added, removed, reshaped, new dtype."""
    if d.status == "reshaped" and d.shape_a is not None and tuple(d.shape_a) == tuple(d.shape):
        return "new dtype"
    return d.status


def _plot_path(traj, ui, path: list[int], out, title: str, metric) -> None:
    """Plot the change between each pair of consecutive steps of ``path`` into ``out``."""
    pairs = list(zip(path, path[1:]))
    columns = []
    with ui.bar(total=len(pairs), desc="comparing consecutive steps", unit="step") as bar:
        for parent, child in pairs:
            columns.append((child, traj.diff(parent, child)))
            bar.update(1)
    plot_diff(columns, out, title, metric)


def _ancestry_between(traj, url: str, a: int, b: int) -> list[int]:
    """The steps from ``a`` to ``b`` along ``b``'s parents, oldest first; an error if ``a`` is not among them."""
    path = []
    for info in traj.log(b):
        path.append(info.step)
        if info.step == a:
            return path[::-1]
    raise InvalidInputError(
        f"--plot draws the steps from A to B along B's parents, and step {a} is not an ancestor of step {b} "
        f"in {url} (`ulstore log {url} {b}` shows its ancestry)"
    )


def _finite(doc: dict) -> dict:
    """JSON has no infinity: a relative change against all zeros is null in --json (``inf`` in Python)."""
    if doc.get("rel_l2") is not None and doc["rel_l2"] == float("inf"):
        doc["rel_l2"] = None
        doc["rel_l2_infinite"] = True
    return doc


def _cmd_gc(args, ui) -> int:
    traj = _open_existing(args, "r+")
    with ui.activity("finding and removing blobs no step uses"):
        result = traj.gc(older_than=args.older_than)
    ui.emit({"url": args.url, **result})
    ui.out(
        f"removed {plural(result['packs'], 'unreferenced pack')}, {human_bytes(result['bytes'])}"
        + (f"; repacked {plural(result['repacked'], 'pack')}" if result["repacked"] else "")
    )
    return EXIT_OK


def _cmd_upgrade(args, ui) -> int:
    from ..store import upgrade

    options = _storage_options(args)
    with ui.bar(total=None, desc="upgrading", unit="step") as bar:

        def progress(done, total):
            bar.total = total
            bar.update(1)

        traj = upgrade(args.url, args.dest, storage_options=options, progress=progress)
    doc = {"url": args.url, "dest": args.dest, "steps": len(traj.steps), "refs": traj.refs}
    ui.emit(doc)
    ui.out(f"upgraded {plural(doc['steps'], 'step')} of {args.url} to format 2 at {args.dest}")
    return EXIT_OK


def _cmd_rm(args, ui) -> int:
    traj = _open_existing(args, "r+")
    info = resolve(traj, args.url, args.step)
    moved = [name for name, step in traj.refs.items() if step == info.step]
    with ui.activity(f"deleting step {info.step}: re-encoding the chunks of other steps coded against it"):
        traj.delete(info.step)
    ui.emit({"url": args.url, "deleted": info.step, "parent": info.parent, "refs_moved": moved})
    ui.out(
        f"deleted step {info.step}"
        + (f"; moved {', '.join(moved)} to {info.parent}" if moved and info.parent is not None else "")
        + f"; run `ulstore gc {args.url}` to free its packs"
    )
    return EXIT_OK


def _cmd_demo(args, ui) -> int:
    from . import demo

    kwargs = {k: v for k, v in (("steps", args.steps), ("preset", args.preset)) if v is not None}
    summary = demo.run(args.dir or demo.DEFAULT_DIR, echo=ui.out, progress=ui.progress, activity=ui.activity, **kwargs)
    ui.emit(summary)
    return EXIT_OK if summary["slice_equal"] and summary["verified"] else EXIT_ERROR
