"""Real torch.distributed jobs for the DCP tests and benchmark: ranks in their own processes, gloo on CPU.

Read me first
-------------
- :func:`run_job` starts ``world`` processes, each a rank of one gloo
  process group (rendezvous through a ``FileStore``, so no port is ever guessed), runs
  ``target(rank, world, *args)`` in every rank and returns one :class:`RankOutcome` per rank.
  A rank that raises reports its traceback; a rank that dies reports its exit code; ranks
  still running at the deadline are killed (by pid: only the processes started here).
  Ranks are forked from a ``forkserver`` that imported torch once (no threads, no process
  group there): a rank starts in well under a second instead of importing torch itself.
- The model is :mod:`ulstore.toytrain`'s byte-level MLP language model ported to
  ``torch.nn`` under the same parameter names, initialised from ``toytrain.init_params``
  (so every world size starts from the same weights), plus a ``(1,)``-shaped
  ``logit_scale`` whose FSDP shard is empty on every rank but the first.  It is sharded
  FSDP2-style (``fully_shard`` per block and at the root) and trained with AdamW on the
  toytrain corpus: real optimizer steps, real Adam moments, uneven shards (150 rows over 4
  ranks is 38 + 38 + 38 + 36).
- The state saved every step is ``{"model", "optim", "tp", "trainer"}``: ``get_state_dict``'s
  DTensors and Adam ``step`` tensors; three DTensors laid out as tensor parallelism does
  (column-sharded bf16, replicated, zero-size); and non-tensor leaves (ints, floats including
  -0.0 and 1e-300, strings, a tuple, a list, None).
- The oracle is independent of any checkpoint storage: after each save, the full state is
  gathered (``full_state_dict=True``) and rank 0 writes it with ``torch.save``, flattened to
  DCP's names (``truth/step-<s>.pt``).  A load job loads a step through DCP at any world
  size, gathers what it loaded the same way and writes ``<out>/step-<s>.pt``; the tests
  compare the two bit for bit (:func:`assert_same_state`).
- Storage is a picklable :class:`Storage` spec, so one job serves every backend: DCP's own
  ``FileSystemWriter``/``Reader`` (one directory per step) and ulstore's.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import struct
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ulstore import toytrain

__all__ = [
    "RankOutcome",
    "run_job",
    "outcomes_ok",
    "Storage",
    "CONFIG",
    "save_job",
    "load_job",
    "read_state",
    "assert_same_state",
    "trainer_leaves",
]

#: the model of the tests: ~360K parameters, ~4.3 MB of fp32 state (weights and Adam moments) per step;
#: 150 rows over 4 ranks are 38 + 38 + 38 + 36
CONFIG = toytrain.ToyConfig(
    context=8, embed_dim=32, hidden_size=150, intermediate_size=450, num_hidden_layers=2, batch_size=16
)


# -- launching ranks ----------------------------------------------------------------------------


@dataclass
class RankOutcome:
    """How one rank ended: ``ok`` with ``value``, or ``error`` (a traceback), or only an ``exitcode``."""

    rank: int
    exitcode: int | None
    ok: bool = False
    value: object = None
    error: str | None = None


def _rank_main(rank: int, world: int, rdv: str, out: str, timeout: float, target, args, kwargs) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rdv}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
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


#: imported once by the fork server, so a rank starts in a fraction of a second instead of
#: importing torch itself (which costs every job seconds per rank on a shared 2-core machine)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "tests.helpers.dcp",
    "ulstore.dcp",
]


def run_job(
    world: int, target, *args, workdir, timeout: float = 300.0, pg_timeout: float = 60.0, kwargs: dict | None = None
) -> list[RankOutcome]:
    """Run ``target(rank, world, *args, **kwargs)`` on ``world`` new ranks; one outcome per rank.

    ``target`` must be importable (a module-level function).  ``workdir`` holds the
    rendezvous file and the results.  ``pg_timeout`` bounds every collective, so a rank
    waiting for a dead peer fails instead of hanging.
    """
    import multiprocessing

    job = Path(workdir) / f"job-{time.time_ns()}"
    job.mkdir(parents=True)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # (only the first job starts the server; later calls change nothing)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, str(job / "rdv"), str(job), pg_timeout, target, args, kwargs or {}),
            daemon=False,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    outcomes = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()  # our own child, by pid
            p.join(10)
        o = RankOutcome(r, p.exitcode)
        res = job / f"rank-{r}.pkl"
        if res.exists():
            with open(res, "rb") as fh:
                status, payload = pickle.load(fh)
            if status == "ok":
                o.ok, o.value = True, payload
            else:
                o.error = payload
        outcomes.append(o)
    return outcomes


def outcomes_ok(outcomes: list[RankOutcome]) -> list:
    """The values of a job in which every rank succeeded; else AssertionError with every rank's story."""
    if all(o.ok and o.exitcode == 0 for o in outcomes):
        return [o.value for o in outcomes]
    story = "\n".join(f"--- rank {o.rank}: exit {o.exitcode}, ok={o.ok}\n{o.error or ''}" for o in outcomes)
    raise AssertionError(f"a rank failed:\n{story}")


# -- storage backends -----------------------------------------------------------------------------


@dataclass
class Storage:
    """Where a job saves and loads: ``kind`` "fs" (DCP's FileSystemWriter/Reader, a directory per
    step under ``url``) or "ulstore" (:mod:`ulstore.dcp`, one trajectory at ``url``)."""

    kind: str
    url: str
    options: dict = field(default_factory=dict)

    def writer(self):
        """A writer reused for every step of a job (``checkpoint_id`` names the step)."""
        if self.kind == "fs":
            return None  # FileSystemWriter is per directory: made per step in save()
        from ulstore import dcp as udcp

        return udcp.Writer(self.url, **self.options)

    def save(self, state: dict, step: int, writer, planner=None) -> None:
        import torch.distributed.checkpoint as dcp

        if self.kind == "fs":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{self.url}/step-{step}"), planner=planner)
        else:
            dcp.save(state, storage_writer=writer, checkpoint_id=step, planner=planner)

    def load(self, state: dict, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.kind == "fs":
            dcp.load(state, storage_reader=dcp.FileSystemReader(f"{self.url}/step-{step}"))
        else:
            from ulstore import dcp as udcp

            dcp.load(state, storage_reader=udcp.Reader(self.url, step=step))


# -- the model ------------------------------------------------------------------------------------


def _modules(config, dtype):
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
            u = self.mlp.up_proj(self.norm(x))
            return x + self.mlp.down_proj(nn.functional.gelu(u, approximate="tanh"))

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
            self.logit_scale = nn.Parameter(torch.ones(1))

        def forward(self, tokens):
            return self.lm_head(self.model(tokens)) * self.logit_scale

    m = ToyLM()
    init = toytrain.init_params(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in init:
                p.copy_(torch.from_numpy(init[name]))
    return m.to(dtype)


def build(world: int, *, config=CONFIG, dtype: str = "float32", lr: float = 1e-3):
    """The toy model sharded FSDP2-style over ``world`` CPU ranks, and its AdamW."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _modules(config, getattr(torch, dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, opt


def train_step(model, opt, step: int, rank: int, world: int, config=CONFIG) -> float:
    """One real AdamW step on this rank's minibatch of the toytrain corpus; returns the mean loss."""
    import torch
    import torch.distributed as dist

    data = toytrain.corpus()
    rng = np.random.default_rng([config.seed, step, rank, world])
    starts = rng.integers(0, len(data) - config.context - 1, size=config.batch_size)
    rows = np.stack([data[s : s + config.context + 1] for s in starts]).astype(np.int64)
    tokens = torch.from_numpy(rows)
    logits = model(tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits, tokens[:, -1])
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the loss every rank saves is the same value: the mean over ranks
    return float(mean) / world


def trainer_leaves(step: int, loss: float) -> dict:
    """The non-tensor leaves saved with every step (awkward ones included)."""
    return {
        "step": step,
        "loss": loss,
        "neg_zero": -0.0,
        "tiny": 1e-300,
        "huge": 2**70,
        "tag": f"run-α/{step}",
        "betas": (0.9, 0.999),
        "history": [step, loss, None, True],
    }


# -- jobs (one call per rank) ---------------------------------------------------------------------


def tp_tensors(step: int) -> dict:
    """Full values of the tensors saved beside the model, as tensor parallelism lays them out."""
    import torch

    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    return {
        "cols": (base * (1 + step / 64)).to(torch.bfloat16),  # Shard(1): column blocks 3+3+3+1 at 4 ranks
        "replicated": torch.linspace(-1, 1, 5) * step,  # Replicate: every rank holds it, one writes it
        "empty": torch.zeros(0, 4, dtype=torch.float16),  # zero elements: exists, holds nothing
    }


def _state(model, opt, step: int, loss: float) -> dict:
    """What every step saves: FSDP-sharded model and Adam state, TP-style DTensors, non-tensor leaves."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = next(model.parameters()).device_mesh
    placements = {"cols": Shard(1), "replicated": Replicate(), "empty": Shard(0)}
    tp = {k: distribute_tensor(v, mesh, [placements[k]]) for k, v in tp_tensors(step).items()}
    msd, osd = get_state_dict(model, opt)  # (initialises the Adam state of a fresh optimizer)
    return {"model": msd, "optim": osd, "tp": tp, "trainer": trainer_leaves(step, loss)}


def _full_flat(model, opt, state: dict | None = None, step: int = 0) -> dict | None:
    """Rank 0: a full state, flattened to DCP's names (tensors on CPU); None elsewhere.  Collective.

    ``state`` None: the oracle, gathered from the live model and optimizer (plus step ``step``'s
    TP tensors and leaves); else a loaded sharded state, each DTensor gathered.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    if state is None:
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full = {"model": msd, "optim": osd, "tp": tp_tensors(step)}
    else:
        flat, _ = flatten_state_dict(state)
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}
    if dist.get_rank() != 0:
        return None
    flat, _ = flatten_state_dict(full)
    return {k: (v.detach().cpu().clone() if hasattr(v, "detach") else v) for k, v in flat.items()}


def save_job(
    rank: int,
    world: int,
    storage: Storage,
    steps,
    truth: str | None,
    *,
    reload: str | None = None,
    config=CONFIG,
    dtype: str = "float32",
    lr: float = 1e-3,
    die: tuple[int, int, int] | None = None,
    resume: int | None = None,
) -> dict:
    """Train and save after every optimizer step in ``steps``; rank 0 writes the gathered truth of
    each saved step to ``truth``.  Steps before ``steps`` are trained, not saved.

    ``reload``: afterwards, load every saved step back at this world size (:func:`load_job`).
    ``resume``: first load that step (through ``storage``) into the model and optimizer, then
    train on from the step after it (a job restarted after a failure, on any number of ranks).
    ``die = (rank, step, n)``: that rank ends its process (``os._exit(17)``) while saving
    ``step``, when the writer asks the planner for its ``n``-th item.  Returns the time of each
    save (and of each reload, under ``"load"``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    steps = list(steps)
    model, opt = build(world, config=config, dtype=dtype, lr=lr)
    start = 0
    if resume is not None:
        state = _state(model, opt, -1, math.nan)
        storage.load(state, resume)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = resume + 1
    writer = storage.writer()
    times: dict = {}
    for s in range(start, max(steps) + 1):
        loss = train_step(model, opt, s, rank, world, config)
        if s not in steps:
            continue
        state = _state(model, opt, s, loss)
        planner = _DyingPlanner(die[2]) if die is not None and die[:2] == (rank, s) else dcp.DefaultSavePlanner()
        t0 = time.perf_counter()
        storage.save(state, s, writer, planner=planner)
        times[s] = time.perf_counter() - t0
        if truth is not None:
            full = _full_flat(model, opt, step=s)
            if full is not None:
                full.update({f"trainer.{k}": v for k, v in state["trainer"].items()})
                _write(full, Path(truth) / f"step-{s}.pt")
    if reload is not None:
        times["load"] = load_job(rank, world, storage, steps, reload, config=config, dtype=dtype)
    return times


def load_job(
    rank: int, world: int, storage: Storage, steps, out: str | None, *, config=CONFIG, dtype: str = "float32"
) -> dict:
    """Load each step through DCP into a fresh model sharded over ``world`` ranks; rank 0 writes
    what was loaded to ``out`` (None: only time the loads).  Returns the time of each load."""
    model, opt = build(world, config=config, dtype=dtype)
    times = {}
    for s in steps:
        state = _state(model, opt, -1, math.nan)  # the template: same names and placements, other values
        t0 = time.perf_counter()
        storage.load(state, s)
        times[s] = time.perf_counter() - t0
        if out is None:
            continue
        full = _full_flat(model, opt, state)
        if full is not None:
            _write(full, Path(out) / f"step-{s}.pt")
    return times


class _DyingPlanner:
    """A DefaultSavePlanner whose ``n``-th ``resolve_data`` ends the process (a rank killed mid-save)."""

    def __new__(cls, n: int):
        import torch.distributed.checkpoint as dcp

        class Dying(dcp.DefaultSavePlanner):
            calls = 0

            def resolve_data(self, write_item):
                Dying.calls += 1
                if Dying.calls >= n:
                    os._exit(17)
                return super().resolve_data(write_item)

        return Dying()


# -- comparing ------------------------------------------------------------------------------------


def _write(obj, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def read_state(path) -> dict:
    """A state written by a job (tensors and plain Python leaves only, so ``weights_only``)."""
    import torch

    return torch.load(path, weights_only=True)


def _same_leaf(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # -0.0 and NaN payloads count
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_leaf(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_leaf(a[k], b[k]) for k in a)
    return a == b


def assert_same_state(got: dict, want: dict) -> None:
    """Same names; tensors of the same dtype and shape with the same bits; other leaves equal, type for type."""
    import torch

    from .bits import assert_bits_equal

    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:10]
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), name
            assert_bits_equal(g, w, name)
        else:
            assert _same_leaf(g, w), f"{name}: {g!r} != {w!r}"


# -- dask workers (module level: workers import them by name) ---------------------------------------


def load_on_worker(reader, template: dict) -> tuple[int, dict]:
    """On a dask worker: ``dcp.load`` into zeros shaped as ``template`` (fqn -> (shape, torch dtype
    name) or a non-tensor leaf) through the pickled ``reader``, in one process.  (pid, state with
    tensors as numpy arrays: dask's own torch serializer refuses bf16)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ulstore.core.torch import from_tensor

    state = {
        k: torch.zeros(v[0], dtype=getattr(torch, v[1])) if isinstance(v, tuple) and len(v) == 2 else v
        for k, v in template.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled": one process
        dcp.load(state, storage_reader=reader, no_dist=True)
    return os.getpid(), {k: from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def box_on_worker(reader, name: str, offset, shape) -> tuple[int, np.ndarray]:
    """On a dask worker: one box of a tensor of the pickled ``reader``'s step (pid, values)."""
    traj = reader.trajectory
    return os.getpid(), traj.read_box(reader.step, name, offset, shape)
