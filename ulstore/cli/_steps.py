"""Steps and refs named on the command line: resolved up front, and a missing one explained with what exists."""

from __future__ import annotations

import bisect
import difflib

from ..errors import StepNotFoundError

__all__ = ["resolve", "missing_step_message"]

#: Up to this many steps, "no such step" lists them all; beyond, the nearest ones.
_LIST_ALL = 8


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
    if isinstance(wanted, str):
        refs = sorted(traj.refs)
        text = f"no step or ref named {wanted!r} in {url}"
        close = difflib.get_close_matches(wanted, refs, n=1, cutoff=0.5)
        if close:
            text += f"; did you mean {close[0]!r}?"
        return text + (f" (refs: {', '.join(refs)})" if refs else " (it has no refs)")
    if not steps:
        return f"no step {wanted}: {url} has no steps yet"
    if len(steps) <= _LIST_ALL:
        return f"no step {wanted} in {url}; its steps are {', '.join(map(str, steps))}"
    i = bisect.bisect_left(steps, wanted)
    near = steps[max(0, i - 2) : i + 2]
    return (
        f"no step {wanted} in {url}; the nearest are {', '.join(map(str, near))} "
        f"({len(steps)} steps from {steps[0]} to {steps[-1]}: `ulstore log {url}` lists them)"
    )
