"""Weight sync for asynchronous RL: a trainer publishes every step to a bucket, replicas follow.

Read me first
-------------
- The trainer and the replicas share nothing but the bucket.  What a trainer
  tells a replica is one small JSON (store URL + version); replicas may also
  just poll.
- The bucket is a ulstore trajectory (one on-storage format): each published
  version is a step on a branch, so ``ulstore.open(url)``, ``ulstore log``,
  ``export``, ``verify`` and lazy slicing work on it.
- :class:`Publisher` commits each version as ULPack deltas of the chunks that
  changed, coded against the previous version (one pack, one step document,
  one ref move); every ``anchor_every`` versions the step also carries a
  snapshot (a full intra copy).  The branch moves last: a version is visible
  only once every object it needs is in place.
- :class:`Follower` loads the newest snapshot, replays the steps after it,
  then applies each new version in place from the store's change feed,
  proving the chain (each step records its parent's content checksum) and
  checking every chunk, all or nothing (a chunk that fails its checks undoes
  every write of the version).  A corrupt or missing step
  makes it re-bootstrap from a snapshot and report it; it never applies
  wrong or partial weights.
- :func:`import_trl` / :func:`export_trl` convert from and to TRL's
  ``sparse_weight_patch`` bucket layout (``anchors/`` + ``deltas/``).

See ``docs/sync.md`` for the bucket layout, guarantees and failure model.

Examples
--------
>>> import numpy as np, ml_dtypes
>>> from ulstore.sync import Publisher, Follower
>>> w = {"w": np.linspace(-1, 1, 64).astype(ml_dtypes.bfloat16)}
>>> with Publisher("memory://sync-pkg-doc") as pub:
...     _ = pub.publish(0, w)
...     w["w"][3] = 7
...     _ = pub.publish(1, w)
>>> f = Follower("memory://sync-pkg-doc")
>>> f.poll(), float(f.state["w"][3])
(1, 7.0)
"""

from ._errors import BucketAccessError, PublishError
from .detector import ChangeDetector
from .follower import Follower, FollowerStats, SyncEvent
from .publisher import DEFAULT_ANCHOR_EVERY, DEFAULT_CHUNK_ELEMS, Publisher, PublishInfo
from .trl import export_trl, gap_decode, gap_encode, import_trl

__all__ = [
    "Publisher",
    "PublishInfo",
    "Follower",
    "SyncEvent",
    "FollowerStats",
    "ChangeDetector",
    "BucketAccessError",
    "PublishError",
    "import_trl",
    "export_trl",
    "gap_encode",
    "gap_decode",
    "DEFAULT_ANCHOR_EVERY",
    "DEFAULT_CHUNK_ELEMS",
]
