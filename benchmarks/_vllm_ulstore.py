"""The ``ulstore`` weight-transfer backend as ``benchmarks/vllm.py`` drives it: the one place that knows its API.

Public API (what a user runs): ``init_weight_transfer_engine`` with the bucket,
then per version ``start_weight_update``, ``update_weights({"version",
"document"})``, ``finish_weight_update``.  Reaching into the worker's engine
(``vllm.v1`` in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) serves only the
benchmark's own needs: waiting for the follower's background scan between
measurements, reading its download counter, the runtime views of the
checkpoint tensors (the mapping the backend learned) for the TRL-style peer,
and the same kernel repack the backend does, for the peers.  If the backend's
internals move, adapt :class:`Backend` only.
"""

from __future__ import annotations

import time

__all__ = ["Backend"]


class Backend:
    """The backend of the single in-process worker of ``llm`` (TP=1)."""

    def __init__(self, llm):
        self.llm = llm
        workers = llm.collective_rpc(lambda w: w)  # in-process engine: the worker object itself
        if len(workers) != 1:
            raise SystemExit("benchmarks/vllm.py runs one in-process worker (TP=1)")
        self.worker = workers[0]
        self.model = self.worker.get_model()
        #: seconds the last :meth:`update` spent repacking kernels (inside the backend)
        self.repack_s = 0.0

    def connect(self, url: str, version: int, document: bytes | None = None) -> None:
        """(Re)connect the worker to ``url`` and move it to ``version`` (a bootstrap: loads that version whole)."""
        self.llm.init_weight_transfer_engine({"init_info": {"url": url}})
        self.update(version, document)
        self.settle()

    def update(self, version: int, document: bytes | None) -> None:
        """Move the engine to ``version``: the weight-transfer API calls a trainer makes (the timed part)."""
        info = {"version": int(version)}
        if document is not None:
            info["document"] = document.decode("ascii")
        self.repack_s = 0.0
        self._watch_repack()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=str(version))

    @property
    def _state(self):
        return self.worker.weight_transfer_engine.state

    def _watch_repack(self) -> None:
        """Time the backend's kernel repack from inside (wraps the connected state's ``kernels.rebuild``)."""
        state = self.worker.weight_transfer_engine.state
        kernels = None if state is None else state.kernels
        if kernels is None or getattr(kernels, "_bench_watched", False):
            return
        rebuild = kernels.rebuild

        def timed() -> None:
            t0 = time.perf_counter()
            rebuild()
            self.repack_s += time.perf_counter() - t0

        kernels.rebuild, kernels._bench_watched = timed, True

    def settle(self) -> None:
        """Wait for the follower's background work (the rotating scan) so the next measurement runs alone."""
        follower = self._state.follower
        if hasattr(follower, "wait_scan"):
            follower.wait_scan()

    def downloaded(self) -> int:
        """Bytes the follower has read from the bucket so far."""
        return int(self._state.follower.stats.bytes_downloaded)

    def repack(self) -> None:
        """Repack the CPU GEMM kernels that hold a copy of their weight, as the backend does after each version."""
        self._state.kernels.rebuild()

    def packed(self) -> int:
        return len(self._state.kernels)

    def views(self) -> dict:
        """Checkpoint name -> flat view of the runtime memory it lands in (every tensor lands whole at TP=1)."""
        state = self._state
        if state.mirrors:
            raise SystemExit(f"tensors that do not land whole in one parameter: {sorted(state.mirrors)[:3]}")
        return {name: t.view(-1) for name, t in state.follower.state.items()}
