"""``ulstore stats --plot`` (raw vs stored bytes and bits per weight, per step) and ``ulstore diff --plot``
(a heatmap of tensors x steps), as PNGs (matplotlib)."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

__all__ = ["check_matplotlib", "has_matplotlib", "plot_report", "plot_diff", "layer_of"]


def has_matplotlib() -> bool:
    """Whether ``--plot`` can work here (matplotlib imports)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def check_matplotlib() -> None:
    from ..core.install import install_command
    from ..errors import InvalidInputError

    if not has_matplotlib():
        raise InvalidInputError(f"--plot needs matplotlib, which is not installed: {install_command('plot')}")


def plot_report(report: dict, out: str, url: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in report["steps"]]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(steps, [r["raw_bytes"] / 1e6 for r in report["steps"]], "o-", ms=3, label="raw (checkpoint)")
    ax.plot(
        steps, [r["stored_bytes"] / 1e6 for r in report["steps"]], "o-", ms=3, label="stored (new blobs + manifest)"
    )
    ax.set_ylabel("MB per step")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"ulstore stats: {url}")
    bx.plot(steps, [r["bits_per_weight"] for r in report["steps"]], "o-", ms=3, color="C2")
    bx.set_ylabel("bits / weight")
    bx.set_xlabel("step")
    bx.set_ylim(bottom=0)
    fig.tight_layout()
    _save(fig, plt, out)


_NUMBER = re.compile(r"(\d+)")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to its first number, else all but its last part.

    >>> layer_of("model.layers.3.mlp.up_proj.weight"), layer_of("model.embed_tokens.weight"), layer_of("w")
    ('model.layers.3', 'model.embed_tokens', 'w')
    """
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _natural(text: str) -> list:
    """Sort key with numbers compared as numbers (layers.2 before layers.10)."""
    return [int(t) if t.isdigit() else t for t in _NUMBER.split(text)]


def plot_diff(columns: list, out: str, title: str, metric: str = "changed") -> None:
    """Heatmap: one row per tensor (grouped by layer), one column per ``(step, diffs against its parent)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = sorted({d.name for _, diffs in columns for d in diffs}, key=lambda n: (_natural(layer_of(n)), _natural(n)))
    row = {n: i for i, n in enumerate(names)}
    grid = np.full((len(names), len(columns)), np.nan)
    for j, (_, diffs) in enumerate(columns):
        for d in diffs:
            value = d.fraction_changed if metric == "changed" else d.rel_l2
            if value is not None and math.isfinite(value):
                grid[row[d.name], j] = value
    height = min(40.0, 2.0 + 0.18 * len(names))
    width = min(30.0, 4.0 + 0.25 * len(columns) + 0.06 * max((len(n) for n in names), default=1))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    label = "fraction of elements changed" if metric == "changed" else "relative L2 change ||b - a|| / ||a||"
    fig.colorbar(image, ax=ax, label=label)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    steps = [str(s) for s, _ in columns]
    every = max(1, len(steps) // 30)
    ax.set_xticks(range(0, len(steps), every), steps[::every], rotation=90, fontsize=7)
    ax.set_xlabel("step (each against its parent)")
    for i in range(1, len(names)):  # a line between layers
        if layer_of(names[i]) != layer_of(names[i - 1]):
            ax.axhline(i - 0.5, color="white", linewidth=0.6)
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, plt, out)


def _save(fig, plt, out: str) -> None:
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
