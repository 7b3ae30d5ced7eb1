"""Store a Hugging Face ``Trainer`` run step by step with a ``TrainerCallback``.

Use it with a real ``transformers.Trainer``::

    from hf_trainer_callback import UlstoreCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[UlstoreCallback("s3://bucket/runs/sft-7", every=50)])
    trainer.train()

Every ``every`` optimizer steps (or, with ``every=None``, whenever the Trainer
saves a checkpoint) the model's ``state_dict()`` becomes a step of the
trajectory, with the latest logged loss and learning rate as metadata.  Only
the main process writes.  Steps that already exist (a resumed run) are
skipped.  The initial weights are stored as step ``global_step`` at the start
of training, so the first trained step is already a small delta.

transformers is imported lazily: creating a ``UlstoreCallback`` makes it a
real ``transformers.TrainerCallback`` subclass when transformers is
installed, and a plain object with the same event methods when it is not (the
Trainer only calls the ``on_*`` methods by name, so both work).

Run this file to see it work: with transformers installed it trains a tiny
GPT-2 built from a config (no download) with a real ``Trainer``; without,
it drives the callback from a plain PyTorch loop with minimal stand-ins for
``TrainingArguments``, ``TrainerState`` and ``TrainerControl``, calling the
events in the order the Trainer does.

    python examples/hf_trainer_callback.py --out runs/hf --steps 20 --every 5
"""

from __future__ import annotations

import argparse
import functools
import types

import ulstore

__all__ = ["UlstoreCallback"]


@functools.cache
def _trainer_callback_base():
    """``transformers.TrainerCallback``, or None when transformers is not installed."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        return None
    return TrainerCallback


@functools.cache
def _with_base(cls, base):
    return type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__doc__": cls.__doc__})


def _noop(*args, **kwargs):
    return None


class UlstoreCallback:
    """A ``TrainerCallback`` that commits the model's weights to a ulstore trajectory.

    Parameters
    ----------
    url : str
        Trajectory URL (local path, ``s3://...``, any fsspec URL); created if missing.
    every : int, optional
        Commit every ``every`` global steps; None: commit whenever the Trainer saves.
    storage_options : dict, optional
        Passed to :func:`ulstore.open` (credentials, endpoint).
    branch : str, optional
        Branch to advance (default ``main``).
    include_initial : bool, default True
        Commit the weights as they are when training begins.
    """

    def __new__(cls, *args, **kwargs):
        base = _trainer_callback_base()
        if base is not None and not issubclass(cls, base):
            cls = _with_base(cls, base)
        return super().__new__(cls)

    def __init__(
        self, url, every: int | None = 100, *, storage_options=None, branch=None, include_initial: bool = True
    ):
        self.url = url
        self.every = every
        self.storage_options = storage_options
        self.branch = branch
        self.include_initial = include_initial
        self.committed: list[int] = []
        self._traj = None

    # -- the events this callback acts on ----------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.include_initial:
            self._commit(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            self._commit(state, model)

    def on_save(self, args, state, control, model=None, **kwargs):
        if not self.every:
            self._commit(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.every:
            self._commit(state, model)  # the final weights, whatever the step

    def __getattr__(self, name):
        # every other Trainer event (on_log, on_evaluate, ... and future ones) is a no-op
        if name.startswith("on_"):
            return _noop
        raise AttributeError(name)

    # -- the work ------------------------------------------------------------------------

    @property
    def trajectory(self):
        if self._traj is None:
            self._traj = ulstore.open(self.url, mode="a", storage_options=self.storage_options)
        return self._traj

    def _commit(self, state, model) -> None:
        if model is None or not getattr(state, "is_world_process_zero", True):
            return
        step = int(state.global_step)
        if step in self.committed or step in self.trajectory:
            return  # already stored (a resumed run, or on_save after on_step_end)
        model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        metadata = {"global_step": step}
        for entry in reversed(getattr(state, "log_history", None) or []):
            if "loss" in entry:
                metadata.update({k: entry[k] for k in ("loss", "learning_rate", "epoch") if k in entry})
                break
        if getattr(state, "epoch", None) is not None:
            metadata.setdefault("epoch", float(state.epoch))
        self.trajectory.commit(step, model.state_dict(), branch=self.branch, metadata=metadata)
        self.committed.append(step)


# ----------------------------------------------------------------------------- demo


def _tiny_gpt2(transformers):
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def _train_with_transformers(transformers, args) -> UlstoreCallback:
    import torch

    torch.manual_seed(0)
    model = _tiny_gpt2(transformers)
    data = [{"input_ids": torch.randint(0, 64, (16,))} for _ in range(64)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    callback = UlstoreCallback(args.out, every=args.every)
    training_args = transformers.TrainingArguments(
        output_dir=args.workdir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data, callbacks=[callback])
    trainer.train()
    return callback


def _simulate_trainer(args) -> UlstoreCallback:
    """A plain PyTorch loop calling the callback's events the way ``Trainer`` does."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(32 * 8, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    training_args = types.SimpleNamespace(output_dir=args.workdir, max_steps=args.steps)
    state = types.SimpleNamespace(
        global_step=0,
        epoch=0.0,
        log_history=[],
        is_world_process_zero=True,
        is_local_process_zero=True,
        max_steps=args.steps,
    )
    control = types.SimpleNamespace(
        should_save=False, should_log=False, should_evaluate=False, should_training_stop=False, should_epoch_stop=False
    )
    callback = UlstoreCallback(args.out, every=args.every)
    events = dict(model=model, optimizer=opt)
    callback.on_init_end(training_args, state, control, **events)
    callback.on_train_begin(training_args, state, control, **events)
    for _ in range(args.steps):
        callback.on_step_begin(training_args, state, control, **events)
        x = torch.randint(0, 64, (16, 8))
        loss = nn.functional.cross_entropy(model(x), x[:, 0])
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.global_step += 1
        state.epoch = state.global_step / args.steps
        state.log_history.append(
            {"loss": round(loss.item(), 4), "learning_rate": 1e-3, "epoch": state.epoch, "step": state.global_step}
        )
        callback.on_log(training_args, state, control, logs=state.log_history[-1], **events)
        callback.on_step_end(training_args, state, control, **events)
    callback.on_train_end(training_args, state, control, **events)
    return callback


def main(argv=None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/hf-trainer", help="trajectory URL (replaced: each run starts over)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--simulate", action="store_true", help="use the stand-in loop even if transformers is installed")
    args = ap.parse_args(argv)
    # a fresh trajectory: on an existing one the callback would skip the steps already there (a resumed run)
    ulstore.open(args.out, mode="w")
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        try:
            import transformers
        except ImportError:
            transformers = None
        if transformers is not None and not args.simulate:
            print(f"training a tiny GPT-2 with transformers {transformers.__version__} Trainer")
            callback = _train_with_transformers(transformers, args)
        else:
            print(
                "transformers is not installed (or --simulate): driving the callback from a plain "
                "PyTorch loop with TrainerState/TrainerControl stand-ins"
            )
            callback = _simulate_trainer(args)
    traj = ulstore.open(args.out, mode="r")
    print(f"committed steps {callback.committed} to {args.out}")
    for info in traj.log():
        loss = info.metadata.get("loss")
        print(f"  step {info.step:4d}  parent {info.parent!s:>4}  loss {loss if loss is not None else '-'}")
    ok = traj.steps == sorted(callback.committed) and traj.verify().ok
    print("verified:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
