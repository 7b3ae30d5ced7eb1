"""The inference side: the ``ulstore`` :class:`~vllm.distributed.weight_transfer.base.WeightTransferEngine`.

One per vLLM worker (each TP rank): ``init_info = {"url", "branch",
"storage_options"}`` connects it to a bucket; ``update_info = {"version": v,
"document": ...}`` moves it to version ``v`` (``"version"`` absent or None: to
the newest published, i.e. follow the branch on demand).  ``document`` is the
version's step document (``PublishInfo.document``) sent with the message, so the
worker reads one range of one pack per version and nothing else.  Writes
happen inside ``update_weights``, which vLLM runs between forward passes, never
during one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...errors import InvalidInputError
from ._model_state import ModelState

__all__ = ["UlstoreEngine", "UlstoreInitInfo", "UlstoreUpdateInfo"]


@dataclass
class UlstoreInitInfo(WeightTransferInitInfo):
    """Where the worker follows: a bucket URL (fsspec: a local path, ``s3://...``), its branch, fsspec options;
    ``trust_state``: skip the follower's rotating re-check of the weights held (:class:`~ulstore.sync.Follower`)."""

    url: str
    branch: str = "main"
    storage_options: dict | None = None
    trust_state: bool = False


@dataclass
class UlstoreUpdateInfo(WeightTransferUpdateInfo):
    """The version to reach (None: the newest published) and, optionally, its step document (str or bytes)."""

    version: int | None = None
    document: str | bytes | None = None


class UlstoreEngine(WeightTransferEngine[UlstoreInitInfo, UlstoreUpdateInfo]):
    """Moves the worker's model from version to version of a ulstore bucket, in place and exactly."""

    init_info_cls = UlstoreInitInfo
    update_info_cls = UlstoreUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.state: ModelState | None = None
        #: the version the model holds once an update finished (None: the weights vLLM started with)
        self.version: int | None = None
        #: wall seconds of the last update in this worker (read, verify, write, sync mirrors, repack)
        self.last_update_seconds: float | None = None

    def init_transfer_engine(self, init_info: UlstoreInitInfo) -> None:
        self.shutdown()
        self.state = ModelState(
            self.model,
            init_info.url,
            branch=init_info.branch,
            storage_options=init_info.storage_options,
            trust_state=init_info.trust_state,
        )

    def start_weight_update(self) -> None:
        pass  # written in place: nothing to prepare

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UlstoreUpdateInfo) -> None:
        if self.state is None:
            raise InvalidInputError(
                'the ulstore backend is not connected: call init_weight_transfer_engine({"init_info": {"url": ...}})'
            )
        v = update_info.version
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InvalidInputError(f"update_info version must be an int >= 0 or None, got {v!r}")
        doc = update_info.document
        t0 = time.perf_counter()
        self.state.update(v, doc.encode("ascii") if isinstance(doc, str) else doc)
        self.last_update_seconds = time.perf_counter() - t0

    def finish_weight_update(self) -> None:
        self.version = None if self.state is None else self.state.version

    def shutdown(self) -> None:
        if self.state is not None:
            self.state.close()
            self.state = None
