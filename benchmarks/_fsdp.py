"""A real FSDP2 training job for ``benchmarks/dcp.py``: ranks in their own processes, gloo on CPU.

Read me first
-------------
- :func:`run_job` starts ``world`` processes, each one rank of a gloo process group
  (rendezvous through a file, so no port is guessed), runs ``target(rank, world, *args)``
  in each and returns every rank's value; if a rank fails, it raises with every rank's story.
  Ranks are forked from a ``forkserver`` that imported torch once, so a rank starts in
  well under a second.
- The model is :mod:`ulstore.toytrain`'s byte-level MLP language model in ``torch.nn``,
  under the same parameter names and initialised from ``toytrain.init_params`` (every world
  size starts from the same weights), sharded with ``fully_shard`` per block and at the root,
  trained with AdamW on the toytrain corpus.
- Every saved step holds ``{"model", "optim", "trainer"}``: ``get_state_dict``'s DTensors
  (weights, Adam moments and step counters) and two non-tensor leaves.
- :class:`Storage` names where a job saves and loads: DCP's own ``FileSystemWriter`` /
  ``FileSystemReader`` (a directory per step) or :mod:`ulstore.dcp` (one trajectory).

The benchmark keeps its own job (the tests have theirs, with an oracle and fault
injection), so that no benchmark imports ``tests``.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ulstore import toytrain

__all__ = ["run_job", "Storage", "save_job", "load_job"]

#: imported once by the fork server (each rank would otherwise import torch itself: seconds per rank)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "benchmarks._fsdp",
]


# -- launching ranks ----------------------------------------------------------------------------


def _rank_main(rank: int, world: int, rdv: str, out: str, timeout: float, target, args, kwargs) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{rdv}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    result: tuple = ("error", "no result")
    try:
        result = ("ok", target(rank, world, *args, **kwargs))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out, f"rank-{rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
        try:
            dist.destroy_process_group()
        except Exception:  # a peer died: nothing to tear down cleanly
            pass


def run_job(world: int, target, *args, workdir, timeout: float = 600.0, kwargs: dict | None = None) -> list:
    """``target(rank, world, *args, **kwargs)`` on ``world`` new ranks: the value of each rank, in rank order.

    ``target`` must be a module-level function (ranks import it by name).  Raises
    RuntimeError naming every rank's exit code and traceback if any rank failed or was
    still running after ``timeout`` seconds (then it is killed, by pid: our own child).
    """
    import multiprocessing

    job = Path(workdir) / f"job-{time.time_ns()}"
    job.mkdir(parents=True)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # (the first job starts the server; later calls change nothing)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, str(job / "rdv"), str(job), 60.0, target, args, kwargs or {}))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values, stories = [], []
    for r, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(10)
        res = job / f"rank-{r}.pkl"
        status, payload = ("error", "no result (killed or died)")
        if res.exists():
            with open(res, "rb") as fh:
                status, payload = pickle.load(fh)
        values.append(payload)
        if status != "ok" or p.exitcode != 0:
            stories.append(f"--- rank {r}: exit {p.exitcode}\n{payload if status != 'ok' else ''}")
    if stories:
        raise RuntimeError(f"{len(stories)} of {world} ranks failed:\n" + "\n".join(stories))
    return values


# -- storage ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """Where a job saves and loads: ``kind`` "fs" (DCP's FileSystemWriter/Reader, a directory per step
    under ``url``) or "ulstore" (:mod:`ulstore.dcp`, one trajectory at ``url``)."""

    kind: str
    url: str
    #: ``ulstore.open`` options of the ulstore writer (e.g. ``anchor_every``)
    options: tuple = ()

    def writer(self):
        """One writer for every step of a job (None for "fs": its writer is per directory)."""
        if self.kind == "fs":
            return None
        from ulstore import dcp as udcp

        return udcp.Writer(self.url, **dict(self.options))

    def save(self, state: dict, step: int, writer) -> None:
        import torch.distributed.checkpoint as dcp

        if self.kind == "fs":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{self.url}/step-{step}"))
        else:
            dcp.save(state, storage_writer=writer, checkpoint_id=step)

    def load(self, state: dict, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.kind == "fs":
            dcp.load(state, storage_reader=dcp.FileSystemReader(f"{self.url}/step-{step}"))
        else:
            from ulstore import dcp as udcp

            dcp.load(state, storage_reader=udcp.Reader(self.url, step=step))


# -- the model ----------------------------------------------------------------------------------


def _toy_lm(config, dtype):
    """toytrain's model as ``torch.nn`` modules, with toytrain's parameter names and initial values."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(config.hidden_size)
            self.mlp = nn.Module()
            self.mlp.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
            self.mlp.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

        def forward(self, x):
            return x + self.mlp.down_proj(nn.functional.gelu(self.mlp.up_proj(self.norm(x)), approximate="tanh"))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(toytrain.VOCAB_SIZE, config.embed_dim)
            self.in_proj = nn.Linear(config.context * config.embed_dim, config.hidden_size)
            self.layers = nn.ModuleList(Block() for _ in range(config.num_hidden_layers))
            self.norm = nn.LayerNorm(config.hidden_size)

        def forward(self, tokens):
            x = self.in_proj(self.embed_tokens(tokens).flatten(1))
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    class ToyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(config.hidden_size, toytrain.VOCAB_SIZE, bias=False)

        def forward(self, tokens):
            return self.lm_head(self.model(tokens))

    model = ToyLM()
    init = toytrain.init_params(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in init:
                p.copy_(torch.from_numpy(init[name]))
    return model.to(dtype)


def _build(world: int, config, dtype: str):
    """The model sharded FSDP2-style over ``world`` CPU ranks, and its AdamW."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _toy_lm(config, getattr(torch, dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _train_step(model, opt, step: int, rank: int, world: int, config) -> float:
    """One AdamW step on this rank's minibatch of the toytrain corpus; the loss averaged over ranks."""
    import torch
    import torch.distributed as dist

    data = toytrain.corpus()
    rng = np.random.default_rng([config.seed, step, rank, world])
    starts = rng.integers(0, len(data) - config.context - 1, size=config.batch_size)
    tokens = torch.from_numpy(np.stack([data[s : s + config.context + 1] for s in starts]).astype(np.int64))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).float(), tokens[:, -1])
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world


def _state(model, opt, step: int, loss: float) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)  # (initialises the Adam state of a fresh optimizer)
    return {"model": msd, "optim": osd, "trainer": {"step": step, "loss": loss}}


# -- jobs (one call per rank) -------------------------------------------------------------------


def save_job(rank: int, world: int, storage: Storage, steps: int, *, config, dtype: str = "float32") -> list[float]:
    """Train ``steps`` optimizer steps and save the whole state after each; the seconds of each ``dcp.save``."""
    model, opt = _build(world, config, dtype)
    writer = storage.writer()
    times = []
    for s in range(steps):
        state = _state(model, opt, s, _train_step(model, opt, s, rank, world, config))
        t0 = time.perf_counter()
        storage.save(state, s, writer)
        times.append(time.perf_counter() - t0)
    return times


def load_job(
    rank: int, world: int, storage: Storage, steps: int, *, config, dtype: str = "float32", repeats: int = 1
) -> list[float]:
    """Load each of ``steps`` saved steps into a fresh sharded model, ``repeats`` times over (steps in order, then
    again); the seconds of each ``dcp.load``, ``repeats`` figures per step (rounds one after the other)."""
    model, opt = _build(world, config, dtype)
    times = []
    for _ in range(repeats):
        for s in range(steps):
            state = _state(model, opt, -1, math.nan)  # the template: same names and placements
            t0 = time.perf_counter()
            storage.load(state, s)
            times.append(time.perf_counter() - t0)
    return times
