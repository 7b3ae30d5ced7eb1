"""``ulstore stats --plot``: raw vs stored bytes and bits per weight, per step, as a PNG (matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_matplotlib", "has_matplotlib", "plot_report"]


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
