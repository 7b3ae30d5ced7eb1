"""Figures the user reads are true: checked against the benchmark's output, or not stated (#38 item 2).

``ulstore demo --help`` promised "about 30 s", the README "5.5 s" (a run took 6 s, another 50 s on a loaded
shared machine), and the README's codec speed column no longer matched docs/performance.md.  Now:

- no help text states a duration or a speed (they depend on the machine and its load);
- the README states no time or speed that docs/performance.md does not (whose figures the benchmark
  scripts write, ``--markdown``, with the date and the command): it points there;
- every size in the README's codec table is docs/performance.md's Table 1, rounded as shown, and the
  README names the date of that measurement.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ulstore.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
PERFORMANCE = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")

#: a duration or a speed: "30 s", "5.5 s", "2 min", "574 MB/s", "1.2 GB/s"
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s*(?:s|sec|seconds|min|minutes|[kMG]B/s)(?![\w/])")


def _helps() -> dict[str, str]:
    parser = build_parser()
    out = {"ulstore": parser.format_help()}
    for action in parser._subparsers._group_actions:  # the commands
        for name, sub in action.choices.items():
            out[name] = sub.format_help()
    return out


def test_no_help_text_states_a_duration_or_a_speed():
    helps = _helps()
    assert "demo" in helps
    found = {name: FIGURE.findall(text) for name, text in helps.items() if FIGURE.search(text)}
    assert not found, found


def test_the_readme_states_no_time_or_speed_of_its_own():
    """Any time or speed the README states is one docs/performance.md states (the benchmark's words, dated):
    the demo's time and the codec speeds are read there, not copied by hand."""
    outside_code = re.sub(r"```.*?```", "", README, flags=re.S)
    own = [f for f in FIGURE.findall(outside_code) if f not in PERFORMANCE]
    assert not own, own


def _codec_rows(text: str) -> dict[str, list[float]]:
    """docs/performance.md Table 1: method -> the numbers of its row."""
    table = text.split("**Table 1. Compressed size**", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = [float(c) if c else None for c in (x.lstrip("+") for x in cells[1:])]
    return rows


def test_the_readme_codec_table_is_the_benchmark_s_table_1():
    section = README.split("<!-- bench:codec -->", 1)[1].split("\n## ", 1)[0]
    measured = re.search(r"Measured (\d{4}-\d\d-\d\d)", PERFORMANCE.split("<!-- bench:codec -->", 1)[1]).group(1)
    assert f"measured {measured}" in section, "the README names the date of docs/performance.md's codec run"
    assert "python benchmarks/codec.py" in README
    rows = _codec_rows(PERFORMANCE)
    methods = ("ULPack", "zstd-19 BG-XOR", "ZipNN XOR")
    readme_rows = [line for line in section.splitlines() if line.startswith("| ") and "%" in line]
    assert len(readme_rows) == 4, readme_rows
    for i, line in enumerate(readme_rows):  # trajectories in Table 1's order: rl, pretrain, fp32, fp16
        cells = [c.strip() for c in line.strip("|").split("|")]
        for method, cell in zip(methods, cells[1:4]):
            m = re.fullmatch(r"\**([\d.]+) %\** \(([\d.]+)\)", cell)
            assert m, cell
            for shown, true in zip(m.groups(), rows[method][2 * i : 2 * i + 2]):
                decimals = len(shown.split(".")[1]) if "." in shown else 0
                assert float(shown) == pytest.approx(round(true, decimals)), (method, i, shown, true)
