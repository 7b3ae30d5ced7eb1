"""The trainer side: publish a version to the bucket, then tell the vLLM engines which version to reach.

:class:`UlstoreTrainer` is the ``ulstore`` ``TrainerWeightTransferEngine``:
``trainer_init`` opens a :class:`~ulstore.sync.Publisher` on the bucket and
connects the engines to it (``init_weight_transfer_engine``);
``send_weights(state, version)`` hands the version to the publisher's background
thread and returns (the trainer blocks for one host copy of the state, or none
with ``copy=False``); once the version is committed, that thread drives
``start_weight_update``, ``update_weights({"version", "document"})``,
``finish_weight_update(str(version))`` through any ``VLLMWeightSyncClient``, then
resets the engines' prefix cache (KV computed with the old weights must not serve
new requests; the worker, where the backend runs, cannot reach the scheduler that
owns that cache).  Versions reach the engines in order; a failure to publish or to
move the engines is raised by the next ``send_weights`` or by ``wait()``.

The control message is a few hundred bytes; the weights go through the bucket.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ...errors import InvalidInputError
from ...sync import DEFAULT_ANCHOR_EVERY, Publisher, PublishInfo

__all__ = ["UlstoreTrainer", "UlstoreTrainerInitInfo", "LLMClient", "HTTPClient"]


@dataclass
class UlstoreTrainerInitInfo(TrainerInitInfo):
    """The bucket, as the trainer writes it (``url``, ``storage_options``) and as the engines read it
    (``engine_url``, ``engine_storage_options``; default: the same)."""

    backend: ClassVar[str] = "ulstore"

    url: str = ""
    branch: str = "main"
    storage_options: dict | None = None
    engine_url: str | None = None
    engine_storage_options: dict | None = None
    anchor_every: int = DEFAULT_ANCHOR_EVERY
    trust_state: bool = False  # the engines skip re-checking the weights they hold (see UlstoreInitInfo)


class UlstoreTrainer(TrainerWeightTransferEngine[UlstoreTrainerInitInfo]):
    """Publishes versions and moves the engines to them.  Only the sender rank (rank 0) publishes."""

    init_info_cls = UlstoreTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, publisher: Publisher | None = None):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publisher = publisher
        self._failed: tuple[int, BaseException] | None = None  # an engine update that failed, not yet raised
        self._lock = threading.Lock()
        self._sent: int | None = None  # the last version handed to the publisher

    @classmethod
    def trainer_init(cls, init_info: UlstoreTrainerInitInfo, *, client, source=None) -> UlstoreTrainer:
        if not init_info.url:
            raise InvalidInputError("UlstoreTrainerInitInfo needs the bucket's url")
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        trainer = cls(client=client, source=source, is_sender=True)
        pub = Publisher(
            init_info.url,
            init_info.anchor_every,
            init_info.storage_options,
            branch=init_info.branch,
            on_commit=trainer._committed,
        )
        engine_options = init_info.engine_storage_options
        client.init_weight_transfer_engine(
            {
                "url": init_info.engine_url or init_info.url,
                "branch": init_info.branch,
                "storage_options": init_info.storage_options if engine_options is None else engine_options,
                "trust_state": init_info.trust_state,
            }
        )
        trainer.publisher = pub
        return trainer

    def send_weights(
        self, state: Mapping | None = None, version: int | None = None, *, copy: bool = True
    ) -> cf.Future | None:
        """Publish ``state`` (default: the ``source`` given at init) as ``version`` (default: the next one) and move
        every engine to it, in the background.

        Returns once the state is copied to host memory (``copy=False``: at once; the caller then leaves the
        tensors alone until the future resolves, e.g. a fresh bf16 cast of the master weights).  The future
        resolves to the :class:`~ulstore.sync.PublishInfo` once the version is committed and the engines were
        told; its exception is the publish's.  None on non-sender ranks.

        Raises
        ------
        ulstore.sync.PublishError, ulstore.integrations.vllm.UpdateRefusedError, ...
            A version sent before failed to publish, or the engines refused it (they hold the version they had).
        """
        if state is None:
            if self.source is None:
                raise InvalidInputError("send_weights needs a state, or a source given to trainer_init")
            state = dict(iter(self.source))  # (every rank iterates: materializing may be a collective)
        if not self.is_sender:
            return None
        assert self.publisher is not None
        self._raise_failed()
        if version is None:  # after the last one sent (versions in flight are not on the branch yet)
            last = self.publisher.latest if self._sent is None else self._sent
            version = 0 if last is None else last + 1
        future = self.publisher.submit(version, state, copy=copy)
        self._sent = version
        return future

    def wait(self) -> None:
        """Wait until every version sent is committed and the engines hold it; raise the first failure."""
        if self.publisher is not None:
            self.publisher.wait()
        self._raise_failed()

    def _committed(self, info: PublishInfo) -> None:
        """The publisher's ``on_commit`` (its background thread, in version order): move the engines."""
        with self._lock:
            if self._failed is not None:
                return  # the engines stay on the version they hold until the failure is raised
        try:
            self.notify(info.version, info.document)
        except BaseException as e:
            with self._lock:
                self._failed = (info.version, e)

    def _raise_failed(self) -> None:
        with self._lock:
            failed, self._failed = self._failed, None
        if failed is not None:
            raise failed[1]

    def notify(self, version: int, document: bytes | None = None) -> None:
        """Move the engines to a published ``version`` (its step document, if given, saves them a read)."""
        update: dict[str, Any] = {"version": int(version)}
        if document is not None:
            update["document"] = document.decode("ascii") if isinstance(document, bytes) else document
        self.client.start_weight_update()
        self.client.update_weights(update)  # raising, the engines are out of the update and keep their version
        self.client.finish_weight_update(weight_version=str(version))
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def shutdown(self) -> None:
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            publisher.close()
        self._raise_failed()


class LLMClient:
    """A ``VLLMWeightSyncClient`` for an ``LLM`` in this process (which also resets its prefix cache)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class HTTPClient:
    """A ``VLLMWeightSyncClient`` for ``vllm serve`` that also resets the prefix cache after each update.

    The server's ``/reset_prefix_cache`` route exists when it runs with
    ``VLLM_SERVER_DEV_MODE=1``; without it, disable prefix caching
    (``--no-enable-prefix-caching``) or reset it another way.
    """

    def __init__(self, base_url: str, timeout: float = 300):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self._http = HTTPVLLMWeightSyncClient(base_url, timeout)
        self.init_weight_transfer_engine = self._http.init_weight_transfer_engine
        self.start_weight_update = self._http.start_weight_update
        self.update_weights = self._http.update_weights
        self.finish_weight_update = self._http.finish_weight_update

    def reset_prefix_cache(self) -> None:
        self._http._post("reset_prefix_cache")
