"""Steps and refs named on the command line: resolved up front, and a missing one explained with what exists."""

from __future__ import annotations

from ..core.formatting import missing_step_message as _missing_step_message
from ..errors import StepNotFoundError

__all__ = ["resolve", "missing_step_message"]


def resolve(traj, url: str, step_or_ref):
    """``traj.info(step_or_ref)``, or a StepNotFoundError that shows which steps or refs exist.

    Examples
    --------
    >>> import numpy as np, ulstore
    >>> traj = ulstore.open("memory://doc-cli-resolve", mode="w")
    >>> for s in (100, 200, 300):
    ...     _ = traj.commit(s, {"w": np.zeros(2, np.float32)})
    >>> resolve(traj, "runs/a", "main").step
    300
    >>> try:
    ...     resolve(traj, "runs/a", 150)
    ... except StepNotFoundError as e:
    ...     print(e)
    no step 150 in runs/a; its steps are 100, 200, 300
    """
    try:
        return traj.info(step_or_ref)
    except StepNotFoundError as e:
        if e.step is not None and e.step != step_or_ref:
            raise  # another step is missing (damage or a concurrent rm): the store's own message says which
        err = StepNotFoundError(missing_step_message(traj, url, step_or_ref))
        err.step = step_or_ref if isinstance(step_or_ref, int) else None  # for --json; not in the text
        raise err from None


def missing_step_message(traj, url: str, wanted) -> str:
    """What to tell a user who named a step or ref that does not exist: the steps or refs that do."""
    steps = traj.steps
    if not steps:  # a fresh trajectory: no step is "missing", there are none yet
        return f"{url} has no steps yet (import checkpoints with `ulstore add {url} CHECKPOINT...`)"
    refs = traj.refs if isinstance(wanted, str) else ()
    return _missing_step_message(url, wanted, steps, refs, listing=f"`ulstore log {url}` lists them")
