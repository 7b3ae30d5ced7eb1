"""Run the ``ulstore`` command with stderr on a pseudo-terminal, as a user sees it (progress bars are drawn)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

__all__ = ["on_a_terminal"]


def on_a_terminal(*args, cwd=None, env=None, columns: int = 200) -> tuple[str, str]:
    """``python -m ulstore.cli ARGS`` with stderr on a terminal of ``columns``; (stderr, stdout) as text.

    Fails the test unless the command exits 0.
    """
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))  # a real terminal has a size
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "ulstore.cli", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=slave,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**os.environ, **(env or {})},
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        out = p.stdout.read() if p.stdout else b""
        status = p.wait(timeout=300)
        assert status == 0, (status, b"".join(chunks))
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace"), out.decode()
