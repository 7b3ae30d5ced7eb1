"""The one error :mod:`ulstore.sync` adds to the ulstore tree.

Everything else the sync layer raises is an existing ulstore error:
:class:`~ulstore.errors.InvalidInputError` for bad arguments or a state dict
that does not match the published tensors, :class:`~ulstore.errors.NotFoundError`
when nothing has been published yet, and the
:class:`~ulstore.errors.IntegrityError` family (``CorruptManifestError``,
``CorruptBlobError``, ``ReferenceMismatchError``) for damaged objects.
"""

from __future__ import annotations

from ..errors import StorageAccessError

__all__ = ["BucketAccessError"]


class BucketAccessError(StorageAccessError):
    """The bucket cannot be used: unreachable, missing, no credentials, or access denied.

    Raised by :class:`~ulstore.sync.Publisher` and :class:`~ulstore.sync.Follower`
    at construction (they probe the bucket), and later if the store becomes
    unreachable.  The message names the URL and the backend's own error; the
    original exception is chained as ``__cause__``.
    """
