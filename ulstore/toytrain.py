"""Real checkpoint trajectories from a tiny numpy language model.

Tests, benchmarks and ``ulstore demo`` need checkpoints produced by *real*
optimizer steps on a *real* loss: Gaussian noise has none of the structure
(slowly drifting weights, most bf16 values bit-identical between RL steps,
per-tensor scale differences) that the ULPack delta codec exploits. This module
trains a character-level MLP language model with hand-written forward/backward
passes and AdamW, in numpy only (torch is an optional extra of ulstore).

Model
    ``k`` previous bytes are embedded, concatenated and projected to
    ``hidden_size``; then ``num_hidden_layers`` pre-LayerNorm residual MLP
    blocks (``x + down(gelu(up(LN(x))))``), a final LayerNorm and ``lm_head``
    predict the next byte (vocabulary of 256 bytes). Parameter names follow the
    Hugging Face convention and weights are stored ``(out_features,
    in_features)`` like ``torch.nn.Linear``::

        model.embed_tokens.weight            (256, embed_dim)
        model.in_proj.weight / .bias         (hidden, context * embed_dim) / (hidden,)
        model.layers.{i}.norm.weight / .bias (hidden,)
        model.layers.{i}.mlp.up_proj.weight / .bias    (intermediate, hidden)
        model.layers.{i}.mlp.down_proj.weight / .bias  (hidden, intermediate)
        model.norm.weight / .bias            (hidden,)
        lm_head.weight                       (256, hidden)

Data
    The bytes of a fixed list of standard-library source files (``textwrap``,
    ``difflib``, ``argparse``, ``inspect``, ``typing``), read from
    ``sysconfig.get_paths()["stdlib"]``. Trajectories are therefore identical
    for identical arguments on one machine and Python version, but may differ
    across Python versions (the sources differ).

Regimes (bf16 checkpoints, 30 steps, measured; see :func:`trajectory`)
    ``"pretrain"``: AdamW at lr 1e-3 from init; on average ~84-85 % of bf16
    elements change at each step on every preset (over 99 % at the first
    steps, 58-74 % at the least dense later ones). What stays put: embedding
    rows of the ~160 byte values absent from the corpus (zero gradient),
    LayerNorm weights near 1.0 (where a bf16 ULP exceeds a 1e-3 step), and
    weights whose noisy Adam update happens to be tiny.
    ``"finetune"``: 100 warm-up steps at 1e-3, then lr 1e-4 and weight decay
    0.01; ~74 % (``tiny``), ~81 % (``small``), ~88 % (``bench``) identical
    per step.
    ``"rl"``: 100 warm-up steps at 1e-3, then lr 3e-6; ~98.1 % (``tiny``),
    ~98.3 % (``small``), ~99.2 % (``bench``) of bf16 elements stay
    bit-identical from one step to the next, never 100 %: the update is far
    below half a bf16 ULP for most weights, and what changes are the
    small-magnitude weights (biases, LayerNorm biases) and those whose fp32
    master value drifts across a rounding boundary.

Examples
--------
>>> cfg = ToyConfig.preset("tiny")
>>> states = trajectory("rl", 3, preset=cfg)
>>> len(states), states[0]["lm_head.weight"].dtype.name
(4, 'bfloat16')
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from functools import lru_cache

import ml_dtypes
import numpy as np

from ._toymodel import AdamW as _AdamW
from ._toymodel import loss_and_grads
from .errors import DtypeError, InvalidInputError

__all__ = [
    "ToyConfig",
    "VOCAB_SIZE",
    "CHECKPOINT_DTYPES",
    "corpus",
    "init_params",
    "loss_and_grads",
    "train",
    "trajectory",
    "save_safetensors",
]

#: Byte-level vocabulary: every byte value is a token, so any text works.
VOCAB_SIZE = 256

#: Checkpoint dtypes :func:`train` can yield, by name.
CHECKPOINT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}

# Fixed, ordered selection so the corpus (hence every trajectory) is deterministic.
_CORPUS_FILES = ("textwrap.py", "difflib.py", "argparse.py", "inspect.py", "typing.py")


@dataclass(frozen=True)
class ToyConfig:
    """Shape, batch and seed of the toy model.

    Parameters
    ----------
    context : int
        Number of previous bytes the model sees.
    embed_dim : int
        Width of each byte embedding.
    hidden_size : int
        Width of the residual stream.
    intermediate_size : int
        Width of each MLP's hidden layer.
    num_hidden_layers : int
        Number of residual MLP blocks (at least 1; presets use 2 or more).
    batch_size : int
        Examples per minibatch.
    seed : int
        Seeds both the initialization and the minibatch sampling.
    """

    context: int = 8
    embed_dim: int = 16
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    batch_size: int = 32
    seed: int = 0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "seed" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidInputError(f"ToyConfig.{f.name} must be an int >= {low}, got {value!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> ToyConfig:
        """Return a named configuration.

        Parameters
        ----------
        name : {"tiny", "small", "bench"}
            ``"tiny"``: ~54K parameters, for tests (ms per step).
            ``"small"``: ~1.7M parameters. ``"bench"``: ~13.5M parameters,
            no tensor above ~8 % of the total.
        **overrides
            Fields to change, e.g. ``seed=1``.

        Returns
        -------
        ToyConfig
        """
        presets = {
            "tiny": dict(
                context=8, embed_dim=16, hidden_size=64, intermediate_size=96, num_hidden_layers=2, batch_size=32
            ),
            "small": dict(
                context=16, embed_dim=32, hidden_size=256, intermediate_size=768, num_hidden_layers=4, batch_size=64
            ),
            "bench": dict(
                context=16, embed_dim=64, hidden_size=512, intermediate_size=2048, num_hidden_layers=6, batch_size=64
            ),
        }
        if name not in presets:
            raise InvalidInputError(f"unknown preset {name!r}; expected one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes, in a fixed order.

        Returns
        -------
        dict of str to tuple of int
        """
        d, f = self.hidden_size, self.intermediate_size
        shapes = {
            "model.embed_tokens.weight": (VOCAB_SIZE, self.embed_dim),
            "model.in_proj.weight": (d, self.context * self.embed_dim),
            "model.in_proj.bias": (d,),
        }
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "norm.weight"] = (d,)
            shapes[p + "norm.bias"] = (d,)
            shapes[p + "mlp.up_proj.weight"] = (f, d)
            shapes[p + "mlp.up_proj.bias"] = (f,)
            shapes[p + "mlp.down_proj.weight"] = (d, f)
            shapes[p + "mlp.down_proj.bias"] = (d,)
        shapes["model.norm.weight"] = (d,)
        shapes["model.norm.bias"] = (d,)
        shapes["lm_head.weight"] = (VOCAB_SIZE, d)
        return shapes

    @property
    def num_params(self) -> int:
        """Total number of parameters."""
        return sum(math.prod(s) for s in self.shapes().values())


@lru_cache(maxsize=1)
def corpus() -> np.ndarray:
    """The training text as a read-only ``uint8`` array of bytes.

    Returns
    -------
    numpy.ndarray
        Concatenated bytes of a fixed list of standard-library source files;
        if none is installed (some distributions ship only ``.pyc``), the
        docstrings of the builtins, in name order.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in _CORPUS_FILES:
        try:
            with open(os.path.join(stdlib, name), "rb") as fh:
                parts.append(fh.read())
        except OSError:
            continue
    if not parts:
        import builtins

        parts = [(getattr(builtins, n).__doc__ or "").encode() for n in sorted(dir(builtins))]
    data = np.frombuffer(b"\n".join(parts), dtype=np.uint8)
    if data.size < 10_000:
        raise InvalidInputError("no usable training text found (stdlib sources and docstrings missing)")
    return data  # frombuffer over bytes is read-only, so the cached array cannot be mutated


def init_params(config: ToyConfig, dtype="float32") -> dict[str, np.ndarray]:
    """Seeded initial parameters (GPT-2 style).

    Matrices are normal with std 0.02 (``down_proj`` scaled by
    ``1/sqrt(2 * num_hidden_layers)`` so the residual stream does not grow with
    depth), biases zero, LayerNorm weights one.

    Parameters
    ----------
    config : ToyConfig
    dtype : numpy dtype, default float32
        ``float64`` is useful for gradient checks.

    Returns
    -------
    dict of str to numpy.ndarray
    """
    rng = np.random.default_rng([config.seed, 0])  # stream 0: init; stream 1: data
    params = {}
    for name, shape in config.shapes().items():
        if name.endswith("norm.weight"):
            p = np.ones(shape)
        elif len(shape) == 1:
            p = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * config.num_hidden_layers) if "down_proj" in name else 0.02
            p = rng.normal(0.0, std, size=shape)
        params[name] = p.astype(dtype)
    return params


def _check_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype in CHECKPOINT_DTYPES:
        return CHECKPOINT_DTYPES[dtype]
    for dt in CHECKPOINT_DTYPES.values():
        try:
            if np.dtype(dtype) == dt:
                return dt
        except TypeError:
            break
    raise DtypeError(f"dtype must be one of {list(CHECKPOINT_DTYPES)}, got {dtype!r}")


def train(
    config: ToyConfig,
    steps: int,
    *,
    lr: float | Callable[[int], float] = 1e-3,
    warmup_steps: int = 0,
    warmup_lr: float = 1e-3,
    dtype="bfloat16",
    weight_decay: float = 0.0,
) -> Iterator[tuple[int, dict[str, np.ndarray], float]]:
    """Train the toy model and yield a checkpoint after every optimizer step.

    First ``warmup_steps`` AdamW steps at ``warmup_lr`` are taken silently
    (so that e.g. an RL-like run does not start at init), then ``steps`` steps
    at ``lr``. It is one run whose learning rate drops: the Adam moments carry
    over, so the yielded steps are steady-state ones, not the atypically large
    first steps of a fresh Adam (whose first update is ``lr * sign(grad)`` for
    every weight).

    Parameters
    ----------
    config : ToyConfig
    steps : int
        Number of yielded optimizer steps; ``steps + 1`` checkpoints result.
    lr : float or callable, default 1e-3
        Learning rate of the yielded steps: a constant, or a function of the
        step index ``k`` giving the rate of the optimizer step that leads from
        checkpoint ``k`` to ``k + 1`` (a schedule in one run, Adam moments and
        minibatches carrying on).
    warmup_steps : int, default 0
    warmup_lr : float, default 1e-3
    dtype : {"bfloat16", "float16", "float32", "float64"} or numpy dtype
        Checkpoint dtype; fp32 master weights are cast (round to nearest even).
    weight_decay : float, default 0.0
        Decoupled AdamW weight decay of the matrices, in both phases.

    Yields
    ------
    step : int
        0 (the init or post-warm-up weights) to ``steps``.
    state : dict of str to numpy.ndarray
        Fresh C-contiguous arrays in ``dtype``, safe to keep.
    loss : float
        Cross-entropy (nats) of these weights on this step's minibatch.
    """
    # validate here, eagerly: a generator function would only raise at the first next()
    out_dtype = _check_dtype(dtype)
    if not isinstance(config, ToyConfig):
        raise InvalidInputError(f"config must be a ToyConfig, got {type(config).__name__}")
    if steps < 0 or warmup_steps < 0:
        raise InvalidInputError("steps and warmup_steps must be >= 0")
    return _train(config, steps, lr, warmup_steps, warmup_lr, out_dtype, weight_decay)


def _train(config, steps, lr, warmup_steps, warmup_lr, out_dtype, weight_decay):
    data = corpus()
    rng = np.random.default_rng([config.seed, 1])
    offsets = np.arange(config.context + 1)

    def batch():
        starts = rng.integers(0, data.size - config.context, size=config.batch_size)
        return data[starts[:, None] + offsets].astype(np.intp)

    params = init_params(config)
    opt = _AdamW(params, weight_decay)
    for _ in range(warmup_steps):
        _, grads = loss_and_grads(params, batch(), config)
        opt.step(params, grads, warmup_lr)
    for step in range(steps + 1):
        loss, grads = loss_and_grads(params, batch(), config, need_grads=step < steps)
        # astype always copies, so the caller's arrays never alias the master weights
        yield step, {k: np.ascontiguousarray(v.astype(out_dtype)) for k, v in params.items()}, loss
        if step < steps:
            opt.step(params, grads, lr(step) if callable(lr) else lr)


# kind -> (warmup_steps, warmup_lr, lr, weight_decay)
_REGIMES = {
    "pretrain": (0, 1e-3, 1e-3, 0.0),
    "finetune": (100, 1e-3, 1e-4, 0.01),
    "rl": (100, 1e-3, 3e-6, 0.0),
}


def trajectory(
    kind: str, steps: int, *, preset: str | ToyConfig = "tiny", dtype="bfloat16", warmup_steps: int | None = None
) -> list[dict[str, np.ndarray]]:
    """Ready-made trajectory of ``steps + 1`` checkpoints.

    Parameters
    ----------
    kind : {"pretrain", "finetune", "rl"}
        ``"pretrain"``: lr 1e-3 from init (dense: nearly every weight changes).
        ``"finetune"``: 100 warm-up steps at 1e-3, then lr 1e-4, weight decay
        0.01 (~75-90 % identical). ``"rl"``: 100 warm-up steps at 1e-3, then
        lr 3e-6 (sparse: ~98-99 % of bf16 weights bit-identical step to step).
    steps : int
    preset : str or ToyConfig, default "tiny"
        Preset name for :meth:`ToyConfig.preset`, or a configuration.
    dtype : str or numpy dtype, default "bfloat16"
    warmup_steps : int, optional
        Overrides the regime's warm-up length (e.g. fewer on big presets).

    Returns
    -------
    list of dict of str to numpy.ndarray
    """
    if kind not in _REGIMES:
        raise InvalidInputError(f"unknown trajectory kind {kind!r}; expected one of {sorted(_REGIMES)}")
    config = preset if isinstance(preset, ToyConfig) else ToyConfig.preset(preset)
    n_warm, warm_lr, lr, wd = _REGIMES[kind]
    if warmup_steps is not None:
        n_warm = warmup_steps
    return [
        state
        for _, state, _ in train(
            config, steps, lr=lr, warmup_steps=n_warm, warmup_lr=warm_lr, dtype=dtype, weight_decay=wd
        )
    ]


def save_safetensors(state: dict[str, np.ndarray], path) -> None:
    """Write a checkpoint as a ``.safetensors`` file.

    A thin wrapper over :func:`safetensors.numpy.save_file`, which stores
    ``ml_dtypes.bfloat16`` arrays as ``BF16`` and loads them back bit-exactly.

    Parameters
    ----------
    state : dict of str to numpy.ndarray
    path : str or os.PathLike
    """
    from safetensors.numpy import save_file  # imported lazily: only this helper needs it

    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, os.fspath(path))
