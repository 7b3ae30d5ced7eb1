"""The backend's own error."""

from __future__ import annotations

from ...errors import UlstoreError

__all__ = ["UpdateRefusedError"]


class UpdateRefusedError(UlstoreError):
    """A version was not applied: the worker still serves the version it had (``held``).

    ``cause`` (also ``__cause__``) says why: a damaged or missing object, a
    version whose tensors are not this model's (missing, renamed, reshaped), an
    unreachable bucket.
    """

    def __init__(self, message: str, *, version=None, held=None):
        super().__init__(message)
        self.version = version
        self.held = held
