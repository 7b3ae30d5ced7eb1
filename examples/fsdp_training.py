"""Train a model with FSDP2 on CPU processes and save every step through torch.distributed.checkpoint.

The integration is the storage writer handed to ``dcp.save``::

    writer = ulstore.dcp.Writer("runs/fsdp")             # once per process, reused
    dcp.save(state, storage_writer=writer, checkpoint_id=step)

Every rank writes its own shards, coded against its own shards of the previous step (which the
reused writer keeps in memory); rank 0 makes the step visible once every rank has written. The
state saved is what ``get_state_dict`` returns: sharded weights, sharded Adam moments, Adam's step
counters and the non-tensor leaves of the optimizer and of this script.

Afterwards the script reads a whole (sharded) weight from the trajectory in this plain process,
then loads the last step into a fresh model sharded over ONE process and checks it computes
exactly what the trained model computed.

    python examples/fsdp_training.py --steps 10 --world 2 --out runs/fsdp
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ulstore
import ulstore.dcp
from ulstore.core.formatting import human_bytes
from ulstore.io import storage_report

IN, WIDTH, OUT = 48, 384, 10


def make_model(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A student MLP sharded over ``world`` ranks (every Linear its own FSDP unit), and its AdamW."""
    torch.manual_seed(0)  # the same initial weights on every rank and every world size
    model = nn.Sequential(nn.Linear(IN, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, OUT))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's minibatch: inputs and what a fixed random teacher network answers."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(64, IN, generator=g)
    teacher = torch.Generator().manual_seed(42)
    w1, w2 = torch.randn(IN, 32, generator=teacher), torch.randn(32, OUT, generator=teacher)
    return x, torch.tanh(x @ w1) @ w2 / 4


def probe() -> torch.Tensor:
    return torch.randn(16, IN, generator=torch.Generator().manual_seed(7))


def setup(rank: int, world: int, rendezvous: str) -> None:
    """Join a gloo process group; ranks meet through a file (no port to pick)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def leave() -> NoReturn:
    """Leave the process group and end this rank's process, skipping interpreter shutdown.

    Call it last, once the rank's work is done.  Once ``fully_shard`` has used the gloo group,
    torch keeps its backend alive after ``destroy_process_group`` (its device mesh holds the
    group, even with the model deleted), so the backend's worker threads outlive the call, and
    a worker may still be dropping the tensors of the last collective.  Dropping a tensor that
    owns a Python object takes the GIL; if the interpreter is shutting down by then, Python
    ends that thread with ``pthread_exit``, the unwinding meets a C++ ``noexcept`` frame and
    the process aborts ("terminate called without an active exception", SIGABRT) -- after
    everything was saved, at random.  ``os._exit`` (how ``multiprocessing`` ends forked
    workers) ends the process without shutting the interpreter down; nothing here needs the
    shutdown: every step is complete when ``dcp.save`` returns.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(rank: int, world: int, out: str, steps: int, scratch: str) -> None:
    setup(rank, world, f"{scratch}/train.rdv")
    model, opt = make_model(world)
    writer = ulstore.dcp.Writer(out)
    for step in range(steps + 1):
        if step:  # step 0 is the initial state
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state, "trainer": {"step": step}}
        dcp.save(state, storage_writer=writer, checkpoint_id=step)
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: saved")
    with torch.no_grad():
        answer = model(probe())
    if rank == 0:
        torch.save(answer, Path(scratch) / "trained.pt")
    leave()


def restore(rank: int, world: int, out: str, step: int, scratch: str) -> None:
    setup(rank, world, f"{scratch}/restore.rdv")
    model, opt = make_model(world)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "trainer": {"step": -1}}
    dcp.load(state, storage_reader=ulstore.dcp.Reader(out, step=step))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with torch.no_grad():
        answer = model(probe())
    if rank == 0:
        torch.save((answer, state["trainer"]["step"]), Path(scratch) / "restored.pt")
    leave()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--world", type=int, default=2, help="training processes")
    p.add_argument("--out", default="runs/fsdp", help="trajectory url (replaced: each run starts over)")
    args = p.parse_args()
    ulstore.open(args.out, mode="w")  # a fresh trajectory: steps are immutable, a second run would find them there
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(train, args=(args.world, args.out, args.steps, scratch), nprocs=args.world)

        traj = ulstore.open(args.out, mode="r")
        report = storage_report(traj)["total"]
        print(
            f"{args.out}: steps {traj.steps[0]}..{traj.steps[-1]}, raw {human_bytes(report['raw_bytes'])}, "
            f"stored {human_bytes(report['stored_bytes'])}"
        )
        weight = traj[args.steps]["model.2.weight"]  # the whole tensor, however it was sharded
        print(f"model.2.weight at step {args.steps}: {weight.shape}, rows 0-1 of column 0: {weight[0:2, 0]}")

        mp.spawn(restore, args=(1, args.out, args.steps, scratch), nprocs=1)
        trained = torch.load(Path(scratch) / "trained.pt")
        restored, saved_step = torch.load(Path(scratch) / "restored.pt")
        same = torch.equal(trained.view(torch.int32), restored.view(torch.int32))
        print(f"restored step {saved_step} on 1 process; outputs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
