"""The errors :mod:`ulstore.sync` adds to the ulstore tree.

Everything else the sync layer raises is an existing ulstore error:
:class:`~ulstore.errors.InvalidInputError` for bad arguments or a state dict
that does not match the published tensors, :class:`~ulstore.errors.NotFoundError`
when nothing has been published yet, and the
:class:`~ulstore.errors.IntegrityError` family (``CorruptManifestError``,
``CorruptBlobError``, ``ReferenceMismatchError``) for damaged objects.
"""

from __future__ import annotations

from ..errors import StorageAccessError, UlstoreError

__all__ = ["BucketAccessError", "PublishError"]


class BucketAccessError(StorageAccessError):
    """The bucket cannot be used: unreachable, missing, no credentials, or access denied.

    Raised by :class:`~ulstore.sync.Publisher` and :class:`~ulstore.sync.Follower`
    at construction (they probe the bucket), and later if the store becomes
    unreachable.  The message names the URL and the backend's own error; the
    original exception is chained as ``__cause__``.
    """


class PublishError(UlstoreError):
    """A version submitted with :meth:`~ulstore.sync.Publisher.submit` was not committed.

    Raised by the next ``submit``/``publish``/``wait``/``close`` after a
    version failed in the background, once every version submitted behind it
    has been refused (versions are committed in order: none after a failure).
    ``version`` names the version that failed and ``refused`` the later ones
    that were not committed; the branch is left on the version before it.
    The original exception is chained as ``__cause__``.  The futures of the
    refused versions fail with a PublishError naming the version that failed.
    """

    def __init__(self, message: str, *, version: int, refused: tuple = ()):
        super().__init__(message)
        self.version = version
        self.refused = tuple(refused)
