"""Render docs/api.md (from docstrings) and docs/cli.md (from the argparse help).

Usage::

    python docs/_gen_api.py           # rewrite both pages
    python docs/_gen_api.py --check   # exit 1 if either page is out of date (tests/test_cli.py runs this)

The pages are generated, never edited by hand: change the docstring or the
parser, then rerun this script and commit its output.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path

DOCS = Path(__file__).resolve().parent
HELP_COLUMNS = 88

# (module, title, names or None for the module's __all__, intro)
SECTIONS = [
    (
        "ulstore",
        "Trajectories",
        [
            "open",
            "Trajectory",
            "store.StepInfo",
            "store.TensorDiff",
            "store.VerifyReport",
            "store.Inventory",
            "store.HEAD",
        ],
        "Open a trajectory, commit checkpoints as steps, read any step back exactly.",
    ),
    (
        "ulstore.io",
        "Checkpoint import and export",
        None,
        "Checkpoint files to steps and back (`ulstore add` / `ulstore export`).",
    ),
    (
        "ulstore.io.checkpoints",
        "Checkpoint files",
        None,
        "Exact reading and writing of safetensors, sharded Hugging Face directories, torch state dicts and npz.",
    ),
    (
        "ulstore",
        "The ULPack codec",
        [
            "encode",
            "decode",
            "encode_many",
            "decode_many",
            "inspect_blob",
            "model_entropy_bits",
            "header_bound",
            "ULPack",
            "backend",
            "set_backend",
            "available_backends",
        ],
        "Code one tensor against a reference; the store uses these per chunk.",
    ),
    (
        "ulstore.dcp",
        "Distributed checkpointing",
        None,
        "torch.distributed.checkpoint storage on a trajectory; see [distributed.md](distributed.md).",
    ),
    ("ulstore.sync", "Weight sync", None, "Trainer -> replica weight sync over a bucket; see [sync.md](sync.md)."),
    ("ulstore.errors", "Errors", None, None),
    (
        "ulstore.toytrain",
        "Toy training runs",
        None,
        "Real checkpoint trajectories from a small numpy language model (tests, benchmarks, the demo).",
    ),
    ("ulstore.cli.demo", "The demo", ["run"], None),
    ("ulstore.cli", "Command line", ["main", "build_parser"], "See also [cli.md](cli.md)."),
]

_SECTION_NAMES = {
    "Parameters",
    "Returns",
    "Yields",
    "Raises",
    "Attributes",
    "Examples",
    "Example",
    "Notes",
    "See Also",
    "Warns",
    "Other Parameters",
}
_LIST_SECTIONS = {"Parameters", "Returns", "Yields", "Raises", "Attributes", "Other Parameters", "Warns"}


# ------------------------------------------------------------------ docstrings


def docstring_to_markdown(doc: str) -> str:
    """numpydoc -> Markdown: sections in bold, parameters as a list, examples fenced."""
    lines = doc.splitlines()
    out: list[str] = []
    section = None
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        # a numpydoc section header: a title underlined with dashes
        if line.strip() and re.fullmatch(r"-{3,}", nxt.strip() or "x") and len(nxt.strip()) >= len(line.strip()) - 1:
            section = line.strip()
            _blank(out)
            out.append(f"**{section}**")
            out.append("")
            i += 2
            continue
        if line.lstrip().startswith(">>>"):
            _blank(out)
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```pycon", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
            continue
        if line.rstrip().endswith("::") and section not in _LIST_SECTIONS:
            # an RST literal block: the indented lines after it
            out.append(_rst_roles(line.rstrip()[:-1] if not line.rstrip().endswith(" ::") else line.rstrip()[:-3]))
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            _blank(out)
            out += ["```text", *textwrap.dedent("\n".join(block)).splitlines(), "```", ""]
            continue
        if section in _LIST_SECTIONS and line.strip() and not line.startswith((" ", "\t")):
            # "name : type" then an indented description
            head = line.strip()
            name, sep, kind = head.partition(" : ")
            desc = []
            i += 1
            while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i].strip()):
                if lines[i + 1 : i + 2] and re.fullmatch(r"-{3,}", lines[i + 1].strip()) and lines[i].strip():
                    break
                desc.append(lines[i].strip())
                i += 1
            text = _rst_roles(" ".join(d for d in desc if d))
            item = f"- **{_md_escape(name)}**" + (f" : {_md_escape(kind)}" if sep else "")
            out.append(item + (f" — {text}" if text else ""))
            continue
        if (
            section not in _LIST_SECTIONS
            and line.strip()
            and not line.startswith((" ", "\t"))
            and nxt.startswith(("    ", "\t"))
            and nxt.strip()
            and not line.lstrip().startswith(("*", "-"))
        ):
            # an RST definition list item: the term in bold, its body as a paragraph
            _blank(out)
            out += [f"**{_rst_roles(line.strip())}**", ""]
            i += 1
            while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i].strip()):
                if not lines[i].strip() and not (lines[i + 1 : i + 2] and lines[i + 1].startswith((" ", "\t"))):
                    break
                out.append(_rst_roles(lines[i].strip()))
                i += 1
            continue
        out.append(_rst_roles(line))
        i += 1
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def _blank(out: list[str]) -> None:
    if out and out[-1].strip():
        out.append("")


def _md_escape(text: str) -> str:
    return _rst_roles(text).replace("*", r"\*").replace("_", r"\_") if "`" not in text else _rst_roles(text)


def _rst_roles(text: str) -> str:
    """``:func:`x``` and ````x```` -> `x`."""
    text = re.sub(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


# ------------------------------------------------------------------- objects


def _resolve(module_name: str, dotted: str):
    import importlib

    obj = importlib.import_module(module_name)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class _Text(str):
    """An annotation written as source text (``from __future__ import annotations``): shown unquoted."""

    def __repr__(self) -> str:
        return str(self)


def _signature(name: str, obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name

    def unquote(ann):
        return _Text(ann.strip("'\"")) if isinstance(ann, str) else ann

    sig = sig.replace(
        parameters=[p.replace(annotation=unquote(p.annotation)) for p in sig.parameters.values()],
        return_annotation=unquote(sig.return_annotation),
    )
    return f"{name}{re.sub(r' at 0x[0-9a-f]+', '', str(sig))}"


def _members(cls):
    """Public methods and properties of a class, in definition order (a few dunders that users call).

    Methods inherited from ulstore's own bases (the store's job mixins) count as
    the class's: base classes first, each in definition order.
    """
    found: dict = {}
    for klass in reversed(cls.__mro__):
        if klass is cls or klass.__module__.startswith("ulstore"):
            found.update(vars(klass))
    for name, value in found.items():
        if name.startswith("_") and name not in ("__getitem__", "__contains__", "__len__", "__enter__"):
            continue
        if isinstance(value, property):
            yield name, value, "property"
        elif isinstance(value, (staticmethod, classmethod)):
            yield name, value.__func__, "method"
        elif inspect.isfunction(value):
            yield name, value, "method"


def render_object(qualname: str, obj, level: int = 3) -> list[str]:
    hashes = "#" * level
    out = []
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        out.append(f"{hashes} `{qualname}`")
        out.append("")
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        sig = _signature(qualname, obj) if kind == "class" and "__init__" in vars(obj) else qualname
        if (
            kind == "class"
            and not inspect.isabstract(obj)
            and obj.__module__.startswith("ulstore.store")
            and qualname.endswith("Trajectory")
        ):
            sig = qualname  # created by ulstore.open, not by hand
        out += ["```python", f"{kind} {sig}" + (f"({', '.join(bases)})" if kind == "exception" else ""), "```", ""]
        doc = inspect.getdoc(obj)
        if doc and (doc != inspect.getdoc(obj.__bases__[0]) or kind != "exception"):
            out += [docstring_to_markdown(doc), ""]
        if kind == "class":
            for name, member, mkind in _members(obj):
                member_doc = inspect.getdoc(member)
                if not member_doc and name.startswith("_"):
                    continue
                label = f"{qualname}.{name}"
                out.append(f"{hashes}# `{label}`")
                out.append("")
                if mkind == "property":
                    out += ["```python", f"{label}  # property", "```", ""]
                else:
                    sig = _signature(label, member).replace("(self, ", "(").replace("(self)", "()")
                    out += ["```python", sig, "```", ""]
                if member_doc:
                    out += [docstring_to_markdown(member_doc), ""]
        return out
    if callable(obj):
        out += [f"{hashes} `{qualname}`", "", "```python", _signature(qualname, obj), "```", ""]
        doc = inspect.getdoc(obj)
        if doc:
            out += [docstring_to_markdown(doc), ""]
        return out
    out += [f"{hashes} `{qualname}`", "", "```python", f"{qualname} = {_value_repr(obj)}", "```", ""]
    return out


def _value_repr(obj) -> str:
    """repr, made deterministic for sets (their order changes with the hash seed)."""
    if isinstance(obj, (set, frozenset)):
        items = ", ".join(sorted(repr(x) for x in obj))
        return f"{type(obj).__name__}({{{items}}})"
    return repr(obj)


def render_api() -> str:
    import importlib

    out = [
        "# Python API reference",
        "",
        "<!-- Generated by docs/_gen_api.py from the docstrings: do not edit by hand. -->",
        "",
        "`import ulstore` gives the trajectory store (`ulstore.open`), the codec and the errors;",
        "`ulstore.io` and `ulstore.io.checkpoints` move checkpoint files in and out.",
        "",
        "Contents:",
        "",
    ]
    body = []
    for module_name, title, names, intro in SECTIONS:
        module = importlib.import_module(module_name)
        anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        out.append(f"- [{title}](#{anchor}) (`{module_name}`)")
        body += [f"## {title}", ""]
        if intro:
            body += [intro, ""]
        if names is None:
            doc = inspect.getdoc(module)
            if doc:
                body += [docstring_to_markdown(doc), ""]
            names = list(module.__all__)
        for name in names:
            obj = _resolve(module_name, name)
            qualname = f"{module_name}.{name}"
            if inspect.isclass(obj) and issubclass(obj, BaseException) and module_name == "ulstore.errors":
                body += render_object(qualname, obj, level=3)
            else:
                body += render_object(qualname, obj, level=3)
    text = "\n".join(out + [""] + body)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return text


# ----------------------------------------------------------------------- cli


def render_cli() -> str:
    os.environ["COLUMNS"] = str(HELP_COLUMNS)
    from ulstore.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = [
        "# Command line reference",
        "",
        "<!-- Generated by docs/_gen_api.py from the argparse parser: do not edit by hand. -->",
        "",
        "Every command takes `--help`, `--json` (one JSON document on stdout), `-q/--quiet` (no",
        "progress bars or notes; bars are drawn on stderr, and only when it is a terminal) and",
        "`--debug` (show the traceback of an error).  Exit status: 0 success, 1 error (bad",
        "checkpoint, missing step, unreachable store, damaged data: one line `ulstore: error: ...`",
        "on stderr), 2 usage error.  URLs are local paths or fsspec URLs; remote filesystem",
        "settings come from `-o KEY=VALUE` or the `ULSTORE_STORAGE_OPTIONS` environment variable",
        "(a JSON object), e.g. `-o endpoint_url=http://127.0.0.1:9000`.",
        "",
        "`python -m ulstore` is the same command.  A bare `ulstore` prints the help below on stdout and",
        "exits 0, as `pip` does.",
        "",
        "With `--json`, an error (a usage error too) is one JSON document on stderr instead of the",
        "`ulstore: error:` line, always of this shape (`step`, `tensor` and `key` are null unless",
        "the error is about one), and warnings are listed under `warnings` in the document on stdout:",
        "",
        "```json",
        '{"error": {"type": "StepNotFoundError", "message": "no step 150 in runs/a; its steps are 100, 200, 300",',
        '           "exit_status": 1, "step": 150, "tensor": null, "key": null}}',
        "```",
        "",
        "A mistyped command or option gets a suggestion (`did you mean 'log'?`); a step or ref that",
        "does not exist is reported with the steps or refs that do (the nearest ones, in a long run).",
        "",
        "Commands: " + ", ".join(f"[`{name}`](#ulstore-{name})" for name in subparsers.choices),
        "",
        "## `ulstore`",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    for name, sub in subparsers.choices.items():
        out += [f"## `ulstore {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a page is out of date instead of writing it")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(DOCS.parent))
    pages = {DOCS / "api.md": render_api(), DOCS / "cli.md": render_cli()}
    stale = []
    for path, text in pages.items():
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if old == text:
            continue
        if args.check:
            stale.append(path)
            diff = difflib.unified_diff(
                old.splitlines(),
                text.splitlines(),
                f"{path.name} (committed)",
                f"{path.name} (from the code)",
                lineterm="",
                n=1,
            )
            print("\n".join(list(diff)[:40]))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(DOCS.parent)}")
    if stale:
        print(f"\nout of date: {', '.join(p.name for p in stale)}; run `python docs/_gen_api.py` and commit the result")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
