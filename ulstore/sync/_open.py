"""Opening a sync bucket: the trajectory store over the store's object client, with sync's access error."""

from __future__ import annotations

from ..core.objects import ObjectStore
from ..store import Trajectory
from ..store import open as open_trajectory
from ._errors import BucketAccessError

__all__ = ["objects", "trajectory"]


def objects(url, storage_options: dict | None) -> ObjectStore:
    """The objects under ``url``, probed: a missing bucket or bad endpoint raises BucketAccessError now."""
    io = ObjectStore.from_url(url, storage_options, access_error=BucketAccessError)
    io.probe()
    return io


def trajectory(io: ObjectStore, mode: str, **kw) -> Trajectory:
    """The trajectory at ``io``.  Sync anchors are snapshots (``snapshot=True`` commits), never full
    intra steps that in-step replicas would have to download, so the session's ``anchor_every`` is 0."""
    return open_trajectory(io, mode=mode, anchor_every=0, **kw)
