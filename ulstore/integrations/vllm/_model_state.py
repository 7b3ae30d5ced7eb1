"""A running vLLM model held equal to one version of a bucket: a :class:`~ulstore.sync.Follower` whose state is
the model's own memory.

For each published tensor the loader observation (:mod:`._mapping`) says
where it lands:

- *direct*: one contiguous run of one parameter, same dtype and element order
  (every tensor of a TP=1 model, fused or not; a tied embedding): the
  follower's state entry **is** that view of vLLM's memory, so a version is
  written in place, changed element by changed element, verified, all or
  nothing (ulstore's in-place apply).
- *mirrored*: anything else (a tensor parallel slice, a cast): the follower
  keeps it in a host tensor of the published shape, and once a version is
  whole the changed tensors' landings are copied into the parameters
  (time and memory in proportion to those tensors, not to the changes).

Then every layer whose kernel packed its weight is repacked (:mod:`._kernels`).
"""

from __future__ import annotations

import logging
import math

import torch

from ...core.torch import dtype_table
from ...errors import NotFoundError, UlstoreError
from ...sync import Follower
from ._kernels import PackedKernels
from ._mapping import LoadMap, observe
from ._refused import UpdateRefusedError

__all__ = ["ModelState"]

log = logging.getLogger("ulstore.integrations.vllm")


class ModelState:
    """``model`` (a vLLM worker's module) following branch ``branch`` of the bucket ``url``.

    Nothing is read or bound until the first :meth:`update`, which learns the
    mapping from that version's tensors and loads it whole (a bootstrap);
    every later version costs its changes.
    """

    def __init__(self, model: torch.nn.Module, url, *, branch: str = "main", storage_options=None, trust_state=False):
        self.model = model
        self.url, self.branch, self.storage_options = url, branch, storage_options
        self.trust_state = bool(trust_state)
        # open now: an unreachable bucket or one holding something else is an error of the init call
        self._probe: Follower | None = Follower(url, branch=branch, storage_options=storage_options, threads=1)
        self.follower: Follower | None = None
        self.map: LoadMap | None = None
        self.mirrors: dict[str, torch.Tensor] = {}
        self.kernels: PackedKernels | None = None

    @property
    def version(self) -> int | None:
        return None if self.follower is None else self.follower.version

    def close(self) -> None:
        for f in (self._probe, self.follower):
            if f is not None:
                f.close()

    # -- connecting -------------------------------------------------------------------

    def _connect(self, version: int | None) -> None:
        probe = self._probe
        assert probe is not None
        step = probe.published() if version is None else version
        if step is None:
            raise NotFoundError(f"nothing is published on branch {self.branch!r} of {probe.url!r}")
        table = dtype_table(torch)
        specs = {n: (tuple(shape), table[dt]) for n, (shape, dt) in probe.trajectory.tensors(step).items()}
        self.kernels = PackedKernels(self.model)  # before observing: a removed weight gets a real one again
        try:
            lmap = observe(self.model, specs)
        except (KeyError, ValueError, AssertionError, RuntimeError) as e:  # the model's loader refusing a name
            raise UpdateRefusedError(
                f"version {step} of {probe.url!r} is not a checkpoint of this model: its load_weights "
                f"raised {type(e).__name__}: {e}",
                version=step,
            ) from e
        state: dict[str, torch.Tensor] = {}
        for name in lmap.landings:
            shape, dtype = specs[name]
            view = lmap.direct(name, shape, dtype)
            if view is None:
                view = self.mirrors[name] = torch.empty(shape, dtype=dtype)
            state[name] = view
        if lmap.ignored:
            log.info("tensors the model does not load, not followed: %s", lmap.ignored)
        self.map = lmap
        self.follower = Follower(
            self.url,
            state=state,
            tensors=list(state),
            branch=self.branch,
            storage_options=self.storage_options,
            trust_state=self.trust_state,
        )
        log.info(
            "following %s: %d tensors in place, %d mirrored (%.1f MB), %d packed kernels",
            probe.url,
            len(state) - len(self.mirrors),
            len(self.mirrors),
            sum(t.numel() * t.element_size() for t in self.mirrors.values()) / 1e6,
            len(self.kernels),
        )

    # -- updating ---------------------------------------------------------------------

    def update(self, version: int | None, document=None) -> int:
        """Move the model to ``version`` (None: the newest published); returns the version now held.

        Raises :class:`UpdateRefusedError` (the model still holds the version it
        had) if the version cannot be applied.
        """
        held = self.version
        try:
            if self.follower is None:
                self._connect(version)
            assert self.follower is not None
            self.follower.poll(to=version, document=document)
        except UpdateRefusedError:
            raise
        except UlstoreError as e:
            raise self._refused(version, held, f"{type(e).__name__}: {e}") from e
        finally:
            if self.version is not None and self.version != held:
                self._sync()
        if version is not None and self.version != version:
            raise self._refused(version, held, self._last_problem())
        assert self.version is not None
        return self.version

    def _refused(self, version, held, why: str) -> UpdateRefusedError:
        now = self.version
        if now is None and self.follower is not None and held is not None:
            state = "holds no whole version (the next update loads one whole)"
        else:
            state = f"still holds version {now}"
        return UpdateRefusedError(
            f"version {version} was not applied, the worker {state}: {why}", version=version, held=now
        )

    def _last_problem(self) -> str:
        events = self.follower.events if self.follower is not None else []
        bad = [e for e in events if e.kind not in ("apply", "bootstrap")]
        if not bad:
            return "it is not reachable from the version held"
        e = bad[-1]
        return f"{e.kind}: {e.detail}"

    def _sync(self) -> None:
        """A new version is whole in the follower's state: copy the mirrored tensors' landings, repack kernels."""
        assert self.map is not None and self.kernels is not None
        with torch.inference_mode():
            for name, mirror in self.mirrors.items():
                flat = mirror.view(-1)
                for a in self.map.landings[name]:
                    a.dst(self.map.targets[a.target]).copy_(a.src(flat))
        self.kernels.rebuild()

    def nbytes_mirrored(self) -> int:
        return sum(math.prod(t.shape) * t.element_size() for t in self.mirrors.values())
