"""The sync store's objects: :class:`~ulstore.core.objects.ObjectStore` with sync's error.

Every backend failure (network, permission, throttling, a missing bucket)
becomes :class:`~ulstore.sync.BucketAccessError` naming the URL and key, with
the backend's exception as ``__cause__``; a missing object is still ``None``.
"""

from __future__ import annotations

from ..core.objects import ObjectStore
from ._errors import BucketAccessError

__all__ = ["open_bucket"]


def open_bucket(url, storage_options: dict | None = None) -> ObjectStore:
    """The objects under ``url``; raises BucketAccessError if the URL cannot be opened."""
    return ObjectStore.from_url(url, storage_options, access_error=BucketAccessError)
