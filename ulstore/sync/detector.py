"""Optimizer hooks that prove which tensors did *not* change, so the publisher can skip them.

At RL learning rates most bf16 weights are bit-identical after a step, but
whole tensors rarely are; what the detector saves is the device-to-host copy
and the comparison of the tensors that are (embeddings of unused tokens,
frozen or gradient-free parameters, norms whose update rounds away).  The
publisher still compares every chunk of the tensors the detector reports as
possibly changed, so a detector can only cost bandwidth, never correctness --
except for changes made *outside* ``optimizer.step()`` (loading weights,
manual edits), which it cannot see.  Those are caught at the next anchor,
where the publisher compares everything and counts ``detector_misses``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import InvalidInputError

__all__ = ["ChangeDetector"]

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class ChangeDetector:
    """Snapshot parameter bits before each optimizer step, compare after.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Hooked with ``register_step_pre_hook`` / ``register_step_post_hook``
        (torch >= 2.1; unwrap Accelerate/DeepSpeed wrappers first).
    params : torch.nn.Module, Mapping of str to Parameter, or iterable of (name, Parameter)
        The parameters to watch, under the names the published state dict uses.
    dtype : torch.dtype or str or None, default "bfloat16"
        Compare the parameters cast to this dtype (what is published, e.g.
        bf16 weights of fp32 master parameters); None compares their own bits.

    Notes
    -----
    A parameter whose ``grad`` is None at the step is treated as unchanged by
    it (``torch.optim`` optimizers skip such parameters).  The snapshot lives
    on the parameter's device: one copy of the watched weights in ``dtype``,
    only during ``step()``.

    Examples
    --------
    >>> import torch
    >>> from ulstore.sync import ChangeDetector
    >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    >>> opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    >>> det = ChangeDetector(opt, model)
    >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    >>> opt.step()  # a 1e-6 step is far below half a bf16 ULP of these weights
    >>> sorted(det.unchanged())
    ['bias', 'weight']
    >>> det.remove()
    """

    def __init__(self, optimizer, params, *, dtype="bfloat16"):
        import torch

        self._torch = torch
        if hasattr(params, "named_parameters"):
            named = list(params.named_parameters())
        elif isinstance(params, Mapping):
            named = list(params.items())
        elif isinstance(params, Iterable):
            named = list(params)
        else:
            raise InvalidInputError(
                "params must be a module, a mapping of name to parameter, or (name, parameter) pairs"
            )
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._params = {name: p for name, p in named if id(p) in in_optimizer}
        #: Names this detector can vouch for (watched parameters the optimizer steps).
        self.watched = frozenset(self._params)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self._snapshot: dict = {}
        self._changed: set[str] = set()
        #: Optimizer steps observed since the last :meth:`reset`.
        self.steps = 0
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def _bits(self, p):
        t = p.detach()
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.view(getattr(self._torch, _INT_OF_SIZE[t.element_size()]))

    def _pre_step(self, optimizer, args, kwargs) -> None:
        # clone: when no cast happens, _bits is a view of the live parameter
        self._snapshot = {
            name: self._bits(p).clone()
            for name, p in self._params.items()
            if p.grad is not None and name not in self._changed
        }

    def _post_step(self, optimizer, args, kwargs) -> None:
        torch = self._torch
        for name, before in self._snapshot.items():
            if not torch.equal(before, self._bits(self._params[name])):  # integer views: exact bits
                self._changed.add(name)
        self._snapshot = {}
        self.steps += 1

    def unchanged(self) -> set[str]:
        """Watched names whose bits did not change in any step since the last :meth:`reset`."""
        return set(self.watched - self._changed)

    def changed(self) -> set[str]:
        """Watched names that changed in some step since the last :meth:`reset`."""
        return set(self._changed)

    def reset(self) -> None:
        """Start a new interval (the publisher calls this after each successful publish)."""
        self._changed.clear()
        self.steps = 0

    def remove(self) -> None:
        """Unhook from the optimizer."""
        for h in self._handles:
            h.remove()
        self._handles = []
