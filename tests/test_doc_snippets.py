"""Every ```python block of README.md and docs/*.md runs, as a reader would paste it.

Each block runs in a fresh interpreter (so it must import what it uses), in a temporary directory,
with the repository's ulstore and no network (Hugging Face offline; nothing is downloaded).  A block
whose first line is ``# continues the block above`` runs after that block, in its interpreter.  A
block that cannot run on its own says why on its first line, ``# not run: <reason>``; those are
listed by :func:`test_blocks_not_run_are_few`, which fails if their number grows without this file
saying so.  ``docs/api.md`` is left out: it is
generated from the docstrings, whose examples run as doctests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "api.md")]
NOT_RUN = "# not run:"
CONTINUES = "# continues the block above"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

#: the blocks that say ``# not run:``, by page and reason (keep this short; a new one must be added here)
EXPECTED_NOT_RUN = {
    (
        "docs/distributed.md",
        "needs a torch.distributed job and a bucket (examples/fsdp_training.py runs one, see below)",
    ),
    (
        "docs/quickstart.md",
        "needs an S3 bucket and credentials (examples/s3_lazy_slice.py runs this against a local S3 server)",
    ),
    (
        "docs/sync.md",
        "a sketch of a trainer and a replica in two processes (the README's sync example runs both in one)",
    ),
    (
        "docs/vllm.md",
        "needs the vllm extra and an HF model directory (tests/integrations/test_vllm.py starts real engines)",
    ),
    (
        "docs/vllm.md",
        "needs the vllm extra, a vLLM server and a bucket (examples/vllm_follow.py runs one in-process)",
    ),
}

_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for where, code in blocks:
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        print(f"--- the block at {where} failed:\n{code}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    print("ran", where)
"""


def blocks(page: Path) -> list[tuple[int, str]]:
    """(line of the block's first line of code, code) of every ```python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def test_every_page_has_its_blocks_found():
    found = {_rel(p): len(blocks(p)) for p in PAGES}
    assert found["README.md"] >= 2 and found["docs/quickstart.md"] >= 4, found


def _runnable(page: Path) -> list[tuple[str, str]]:
    return [(f"{_rel(page)}:{line}", code) for line, code in blocks(page) if not code.startswith(NOT_RUN)]


def _sessions(page: Path) -> list[list[tuple[str, str]]]:
    """The runnable blocks of ``page`` in interpreters: a new one per block, unless it continues the one above."""
    out: list[list[tuple[str, str]]] = []
    for where, code in _runnable(page):
        if code.startswith(CONTINUES):
            assert out, f"{where}: {CONTINUES!r}, but no block above runs"
            out[-1].append((where, code))
        else:
            out.append([(where, code)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=_rel)
def test_the_python_blocks_of_a_page_run(page, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ULSTORE_")}
    env.update(
        PYTHONPATH=str(REPO),  # this checkout's ulstore
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        MPLBACKEND="Agg",
        HOME=str(tmp_path),  # no user config, caches in the temporary directory
    )
    for i, session in enumerate(_sessions(page)):
        cwd = tmp_path / f"session-{i}"
        cwd.mkdir()
        p = subprocess.run(
            [sys.executable, "-c", _RUNNER],
            input=json.dumps(session),
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-6000:]
        ran = [line for line in p.stdout.splitlines() if line.startswith("ran ")]  # (blocks print too)
        assert ran == [f"ran {where}" for where, _ in session], p.stdout


def test_blocks_not_run_are_few():
    marked = {
        (_rel(p), code.splitlines()[0][len(NOT_RUN) :].strip())
        for p in PAGES
        for _, code in blocks(p)
        if code.startswith(NOT_RUN)
    }
    total = sum(len(blocks(p)) for p in PAGES)
    print(f"{total - len(marked)} of {total} python blocks run; {len(marked)} not run by marker: {sorted(marked)}")
    assert marked == EXPECTED_NOT_RUN
