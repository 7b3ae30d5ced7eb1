"""torch.distributed.checkpoint (DCP) on ulstore: every rank writes its own shards, one step appears.

``Writer`` is a DCP ``StorageWriter`` and ``Reader`` a ``StorageReader``::

    import torch.distributed.checkpoint as dcp
    from ulstore.dcp import Writer, Reader

    writer = Writer("s3://bucket/run-7")               # one per process, reused for every save
    for step in range(...):
        train_one_step()
        dcp.save(state, storage_writer=writer, checkpoint_id=step)

    dcp.load(state, storage_reader=Reader("s3://bucket/run-7", step=120))

Each rank codes its shards against its own shards of the parent step (kept in memory by the
reused ``Writer``) into its own packs; the coordinator makes the step visible last, by
conditional create.  A step is a plain ulstore step: ``ulstore.open(url)[step]["model.w"]`` is
the whole tensor; loading at another world size or sharding is exact.  See
``docs/distributed.md``.  Needs torch (the ``torch`` extra: importing this package without it
raises an ImportError naming the pip command for your install).
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as _e:
    from ..core.install import install_command as _install_command

    raise ModuleNotFoundError(
        f"ulstore.dcp needs PyTorch, which is not installed: {_install_command('torch')}", name="torch"
    ) from _e

from ._storage_reader import Reader
from ._storage_writer import Writer

__all__ = ["Writer", "Reader"]
