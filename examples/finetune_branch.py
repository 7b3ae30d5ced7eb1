"""Store fine-tunes as branches of their base model.

A fine-tune starts from a base checkpoint.  Committed with ``parent=`` the
base step and its own ``branch=``, its very first step is a small delta
against the base instead of a full copy, and every later step a delta against
the one before::

    traj.commit(step, state, parent=base_step, branch="ft-a")

This script trains a base model (numpy only: ``ulstore.toytrain``), stores it
on ``main``, then runs two fine-tunes from its last step on branches ``ft-a``
(lr 1e-4) and ``ft-b`` (lr 3e-6, like an RL run), and checks two things,
reported separately: every branch head reads back exactly, and each branch
costs less than the same fine-tune stored on its own.

Anchors decide the second.  A chain gets a full (intra) anchor every
``anchor_every`` steps (16 here) so that no read walks back further, and a
branch continues its base's chain: a branch off a step 14 steps past an anchor
gets its own anchor 2 steps in, and then costs about what it costs alone (one
anchor each).  Branch off an anchor, or shortly after one, and the branch is
all deltas.  With 32 base steps the base's last step (32) is an anchor:

    python examples/finetune_branch.py --out runs/branches --base-steps 32 --ft-steps 10

(``--base-steps 30`` puts the base head 14 steps past an anchor: the script
then says that the branches cost about what they cost alone, and exits 1.)
"""

from __future__ import annotations

import argparse

import numpy as np

import ulstore
from ulstore import toytrain
from ulstore.core.formatting import human_bytes
from ulstore.io import storage_report

FINETUNES = {"ft-a": 1e-4, "ft-b": 3e-6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/finetune-branches", help="trajectory URL")
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "bench"])
    ap.add_argument("--base-steps", type=int, default=30)
    ap.add_argument("--ft-steps", type=int, default=10)
    args = ap.parse_args(argv)
    cfg = toytrain.ToyConfig.preset(args.preset)

    traj = ulstore.open(args.out, mode="w", anchor_every=16)  # the fixed cadence this example is about
    base = train_base(traj, cfg, args.base_steps)
    finetuned = {
        branch: finetune(traj, cfg, branch, lr, 1000 * (i + 1), base, args)
        for i, (branch, lr) in enumerate(FINETUNES.items())
    }
    exact, cheaper = compare(traj, base, finetuned)
    print(f"\nancestry of ft-a: {[info.step for info in traj.log('ft-a')][:4]} ... back to step 0")
    print("heads exact:", bool(exact))
    print("branches cheaper than stored alone:", bool(cheaper))
    if not cheaper:
        print(
            "  (an anchor fell inside a branch: the chain's anchor cadence continues from the base, so the branch "
            "pays for an anchor as the standalone run does; branch off an anchor to save it, see the docstring)"
        )
    return 0 if exact and cheaper else 1


def train_base(traj, cfg, steps: int) -> int:
    """Train and commit the base model on ``main``; returns its last step."""
    for step, state, loss in toytrain.train(cfg, steps, lr=1e-3):
        traj.commit(step, state, metadata={"loss": round(loss, 4), "phase": "base"})
    base = traj.head()
    print(f"base: steps 0-{base} on main, loss {loss:.3f}")
    return base


def finetune(traj, cfg, branch: str, lr: float, first_step: int, base: int, args) -> list[dict]:
    """Fine-tune from the base on ``branch`` (steps ``first_step + 1, ...``); returns the states committed."""
    states = []
    # toytrain replays the base run as warm-up, so its step 0 is the base's last step, bit for bit
    run = toytrain.train(cfg, args.ft_steps, lr=lr, warmup_steps=args.base_steps)
    for k, state, loss in run:
        if k == 0:
            assert same_bits(state, traj.read(base))
            continue
        step = first_step + k  # any numbering works; steps are unique across branches
        # --- the integration: the first step of a branch names the base as its parent; ----
        # --- the next ones default to the branch's head -----------------------------------
        parent = base if k == 1 else ulstore.store.HEAD
        traj.commit(step, state, parent=parent, branch=branch, metadata={"loss": round(loss, 4), "lr": lr})
        states.append(state)
    print(f"{branch}: {args.ft_steps} steps at lr {lr:g} from step {base}, head {traj.head(branch)}, loss {loss:.3f}")
    return states


def compare(traj, base: int, finetuned: dict[str, list[dict]]) -> tuple[bool, bool]:
    """Print what each branch costs, stored as a branch and on its own; returns (heads exact, branches cheaper)."""
    report = {r["step"]: r for r in storage_report(traj)["steps"]}
    print(f"\nrefs: {traj.refs}")
    print(
        f"base head {base} is {traj.info(base).anchor_distance} step(s) past an anchor (one every {traj.anchor_every})"
    )
    print(f"{'':8}{'steps':>6}{'anchors':>8}{'stored as a branch':>20}{'stored on its own':>20}")
    base_bytes = sum(report[s]["stored_bytes"] for s in range(base + 1))
    base_anchors = sum(1 for s in range(base + 1) if traj.info(s).anchor_distance == 0)
    print(f"{'main':8}{base + 1:>6}{base_anchors:>8}{human_bytes(base_bytes):>20}{'-':>20}")
    cheaper = exact = True
    for branch, states in finetuned.items():
        steps = [info.step for info in traj.log(branch) if info.step > base]
        anchors = [s for s in steps if traj.info(s).anchor_distance == 0]
        as_branch = sum(report[s]["stored_bytes"] for s in steps)
        alone = ulstore.open(f"memory://finetune-alone-{branch}", mode="w", anchor_every=16)
        for k, state in enumerate(states, 1):
            alone.commit(k, state)
        alone_bytes = alone.stats()["stored_bytes"]
        print(f"{branch:8}{len(steps):>6}{len(anchors):>8}{human_bytes(as_branch):>20}{human_bytes(alone_bytes):>20}")
        cheaper &= as_branch < alone_bytes
        exact &= same_bits(traj.read(branch), states[-1])  # each branch head reads back exactly
    return exact, cheaper


def same_bits(got: dict, want: dict) -> bool:
    """``got`` holds every tensor of ``want`` with its bits (bf16 compared as 16-bit words: NaNs count)."""
    return all(np.array_equal(got[n].view(np.uint16), v.view(np.uint16)) for n, v in want.items())


if __name__ == "__main__":
    raise SystemExit(main())
