"""Human-readable sizes and counts, for reports, the CLI, the demo and the examples."""

from __future__ import annotations

import re

__all__ = ["human_bytes", "binary_bytes", "plural", "strip_ansi"]

# CSI sequences (colours, bold: ESC [ ... letter) and the two-character escapes
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def human_bytes(n: float) -> str:
    """Decimal units, at most three significant digits.

    Examples
    --------
    >>> human_bytes(999), human_bytes(3_600_000), human_bytes(45_170_000), human_bytes(1.5e9)
    ('999 B', '3.6 MB', '45.2 MB', '1.5 GB')
    """
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def binary_bytes(n: int) -> str:
    """``4194304`` -> ``'4 MiB'`` (chunk sizes are powers of two more often than not).

    >>> binary_bytes(4 << 20), binary_bytes(1536), binary_bytes(12)
    ('4 MiB', '1.5 KiB', '12 B')
    """
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def plural(count: int, word: str) -> str:
    """``plural(1, "step") == "1 step"``, ``plural(3, "step") == "3 steps"``.

    >>> plural(1, "step"), plural(1200, "blob")
    ('1 step', '1,200 blobs')
    """
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, bold), e.g. from a library's error message.

    >>> strip_ansi("\\x1b[1mdo this only if you trust it\\x1b[0m.")
    'do this only if you trust it.'
    """
    return _ANSI.sub("", text)
