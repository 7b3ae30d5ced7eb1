"""How a command ends: the exit statuses, and the usage errors that end it with status 2.

Its own module because every other module of the CLI needs these: the parser
raises :class:`ArgumentUsageError`, the commands raise :class:`UsageError`, and
the UI reports both as ``"UsageError"``.
"""

from __future__ import annotations

import argparse

from ..errors import InvalidInputError

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "UsageError", "ArgumentUsageError"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class UsageError(InvalidInputError):
    """A usage error only found after parsing (``-o``, ``ULSTORE_STORAGE_OPTIONS``): exit status 2, like argparse's."""


class ArgumentUsageError(Exception):
    """argparse found a usage error: ``parser`` is the (sub)parser whose usage applies; exit status 2."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser
        self.message = message
