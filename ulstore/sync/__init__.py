"""Weight sync for asynchronous RL: a trainer publishes every step to a bucket, replicas follow.

Read me first
-------------
- The trainer and the replicas share nothing but the bucket.  What a trainer
  tells a replica is one small JSON (store URL + version); replicas may also
  just poll.
- :class:`Publisher` writes each version as ULPack deltas of the chunks that
  changed, coded against the previous version; every ``anchor_every``
  versions it also writes a full anchor.  ``latest.json`` is written last: a
  version is visible only once every object it needs is in place.
- :class:`Follower` loads the newest anchor, replays the deltas after it, then
  applies each new version in place, verified end to end (pack addresses,
  ULPack checksums, per-chunk hashes, a checksummed manifest chain from
  ``latest.json``) *before* writing anything.  A corrupt or missing delta
  makes it re-bootstrap from an anchor and report it; it never applies
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

from ._errors import BucketAccessError
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
    "import_trl",
    "export_trl",
    "gap_encode",
    "gap_decode",
    "DEFAULT_ANCHOR_EVERY",
    "DEFAULT_CHUNK_ELEMS",
]
