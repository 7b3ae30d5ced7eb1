"""Save a checkpoint every N steps from a plain PyTorch training loop.

The whole integration is one line in the loop::

    traj.commit(step, model.state_dict(), metadata={"loss": loss.item()})

``commit`` takes torch tensors as they are (bf16 included), stores each step as
a lossless delta against the previous one, and returns once the step is
durable.  Reading back is just as short::

    model.load_state_dict(ulstore.io.to_torch(traj, step))

This script trains a small MLP language model on bytes of its own source code
(so it needs nothing but torch), saves every ``--every`` steps, then restores
an old step into a fresh model and checks it computes exactly what the
original did at that step.

    python examples/pytorch_training_loop.py --steps 200 --every 20 --out runs/loop
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

import ulstore
from ulstore.core.formatting import human_bytes
from ulstore.io import storage_report, to_torch


class ByteMLP(nn.Module):
    """Predict the next byte from the previous ``context`` bytes."""

    def __init__(self, context: int = 8, width: int = 128):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, 32)
        self.body = nn.Sequential(
            nn.Linear(32 * context, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()
        )
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        return self.head(self.body(self.embed(x).flatten(1)))


def batches(data: torch.Tensor, context: int, batch_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(context + 1)
        window = data[idx]
        yield window[:, :-1], window[:, -1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/pytorch-loop", help="trajectory URL (local path, s3://...)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype the model trains in (bf16 halves the checkpoints)",
    )
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    data = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
    model = ByteMLP(width=args.width).to(getattr(torch, args.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = batches(data, model.context, 64)
    probe = next(batches(data, model.context, 16, seed=1))[0]  # fixed inputs to check restores on

    traj = ulstore.open(args.out, mode="w")  # "w" starts over; "a" would append to an existing run
    saved_outputs = {}
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        x, y = next(stream)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        if step % args.every == 0:
            # --- the integration: one commit per saved step ---------------------------------
            traj.commit(step, model.state_dict(), metadata={"loss": round(loss.item(), 4)})
            with torch.no_grad():
                saved_outputs[step] = model(probe)
            print(f"step {step:5d}  loss {loss.item():.3f}  saved")
        if step < args.steps:
            opt.zero_grad()
            loss.backward()
            opt.step()
    elapsed = time.perf_counter() - t0

    # Restore an early step into a fresh model: it must compute exactly what the original did.
    old = sorted(saved_outputs)[1] if len(saved_outputs) > 1 else 0
    fresh = ByteMLP(width=args.width).to(getattr(torch, args.dtype))
    fresh.load_state_dict(to_torch(ulstore.open(args.out, mode="r"), old))
    with torch.no_grad():
        same = torch.equal(fresh(probe), saved_outputs[old])
    report = storage_report(traj)["total"]
    print(
        f"\n{len(saved_outputs)} checkpoints of {sum(p.numel() for p in model.parameters()):,} parameters "
        f"({args.dtype}) in {elapsed:.1f} s"
    )
    print(
        f"raw {human_bytes(report['raw_bytes'])}, stored {human_bytes(report['stored_bytes'])} "
        f"({report['bits_per_weight']:.2f} bits/weight) at {args.out}"
    )
    print(f"restored step {old} into a fresh model: outputs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
