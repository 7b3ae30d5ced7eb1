"""Tests of the numpy toy trainer that produces real checkpoint trajectories."""

import re

import ml_dtypes
import numpy as np
import pytest

from ulstore.errors import DtypeError, InvalidInputError
from ulstore.toytrain import (
    CHECKPOINT_DTYPES,
    ToyConfig,
    init_params,
    loss_and_grads,
    save_safetensors,
    train,
    trajectory,
)

TINY = ToyConfig.preset("tiny")


def _identical_fractions(states):
    """Per step: fraction of all elements whose bits equal the previous checkpoint's."""
    fracs = []
    for a, b in zip(states, states[1:]):
        same = sum(
            int(
                (a[k].view(np.uint8).reshape(a[k].size, -1) == b[k].view(np.uint8).reshape(b[k].size, -1))
                .all(axis=1)
                .sum()
            )
            for k in a
        )
        fracs.append(same / sum(v.size for v in a.values()))
    return np.array(fracs)


def test_loss_decreases():
    losses = [loss for _, _, loss in train(TINY, 30)]
    assert len(losses) == 31
    assert np.isfinite(losses).all()
    # ln(256) = 5.55 at init; a trained byte model must do clearly better
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5


def test_gradients_match_finite_differences():
    cfg = ToyConfig(
        context=3, embed_dim=4, hidden_size=6, intermediate_size=10, num_hidden_layers=2, batch_size=5, seed=3
    )
    rng = np.random.default_rng(0)
    # perturb the init so biases and LayerNorm parameters are not at 0 / 1
    params = {k: v + rng.normal(0, 0.3, v.shape) for k, v in init_params(cfg, np.float64).items()}
    tokens = rng.integers(0, 256, size=(cfg.batch_size, cfg.context + 1))
    tokens[1, 0] = tokens[0, 0]  # a byte repeated in the batch: embedding grads must accumulate
    _, grads = loss_and_grads(params, tokens, cfg)
    eps = 1e-6
    for name, p in params.items():
        assert grads[name].shape == p.shape and grads[name].dtype == np.float64
        for i in range(3):
            if name == "model.embed_tokens.weight":  # only rows of bytes in the batch have gradients
                row = tokens[0, 0] if i == 0 else rng.choice(tokens[:, :-1].ravel())
                idx = (row, rng.integers(p.shape[1]))
            else:
                idx = tuple(rng.integers(n) for n in p.shape)
            old = p[idx]
            p[idx] = old + eps
            up, _ = loss_and_grads(params, tokens, cfg, need_grads=False)
            p[idx] = old - eps
            down, _ = loss_and_grads(params, tokens, cfg, need_grads=False)
            p[idx] = old
            numeric = (up - down) / (2 * eps)
            assert abs(numeric - grads[name][idx]) <= 1e-7 + 1e-5 * abs(numeric), (name, idx)


def test_deterministic_and_seeded():
    def run(seed):
        return [s for _, s, _ in train(ToyConfig.preset("tiny", seed=seed), 4, warmup_steps=3)]

    a, b, c = run(0), run(0), run(1)
    for sa, sb in zip(a, b):
        assert all(sa[k].tobytes() == sb[k].tobytes() for k in sa)
    assert a[0]["lm_head.weight"].tobytes() != c[0]["lm_head.weight"].tobytes()


def test_rl_regime_is_sparse_but_not_frozen():
    fracs = _identical_fractions(trajectory("rl", 10))
    assert (fracs > 0.9).all() and (fracs < 1.0).all(), fracs


def test_pretrain_regime_is_dense():
    fracs = _identical_fractions(trajectory("pretrain", 10))
    assert (1 - fracs > 0.5).all(), fracs


def test_finetune_between_pretrain_and_rl():
    ft = _identical_fractions(trajectory("finetune", 5)).mean()
    assert _identical_fractions(trajectory("pretrain", 5)).mean() < ft
    assert ft < _identical_fractions(trajectory("rl", 5)).mean()


@pytest.mark.parametrize("dtype", list(CHECKPOINT_DTYPES))
def test_dtypes_names_and_layout(dtype):
    states = list(train(TINY, 2, dtype=dtype))
    assert [s for s, _, _ in states] == [0, 1, 2]
    state = states[-1][1]
    assert list(state) == list(TINY.shapes())
    assert sum(v.size for v in state.values()) == TINY.num_params
    name_re = re.compile(
        r"(lm_head|model\.(embed_tokens|in_proj|norm"
        r"|layers\.\d+\.(norm|mlp\.(up|down)_proj)))\.(weight|bias)"
    )
    for name, arr in state.items():
        assert name_re.fullmatch(name), name
        assert arr.dtype == CHECKPOINT_DTYPES[dtype] and arr.flags.c_contiguous
        assert arr.shape == TINY.shapes()[name]
    # cast is round-to-nearest from the same fp32 master weights
    f32 = list(train(TINY, 2, dtype="float32"))[-1][1]
    for name in state:
        np.testing.assert_array_equal(state[name], f32[name].astype(CHECKPOINT_DTYPES[dtype]))


def test_yielded_arrays_are_independent_copies():
    gen = train(TINY, 3, dtype="float32")
    _, first, _ = next(gen)
    saved = {k: v.copy() for k, v in first.items()}
    for _ in gen:
        pass
    assert all(np.array_equal(first[k], saved[k]) for k in saved)


def test_warmup_moves_away_from_init():
    init = next(train(TINY, 0, dtype="float32"))[1]
    warm = next(train(TINY, 0, warmup_steps=5, dtype="float32"))[1]
    assert not np.array_equal(init["lm_head.weight"], warm["lm_head.weight"])


def test_presets_sizes_and_balance():
    sizes = {name: ToyConfig.preset(name).num_params for name in ("tiny", "small", "bench")}
    assert 30_000 < sizes["tiny"] < 80_000
    assert 1_000_000 < sizes["small"] < 2_500_000
    assert 10_000_000 < sizes["bench"] < 30_000_000
    shapes = ToyConfig.preset("bench").shapes()
    assert max(np.prod(s) for s in shapes.values()) < 0.4 * sizes["bench"]


def test_invalid_arguments():
    with pytest.raises(InvalidInputError):
        ToyConfig.preset("huge")
    with pytest.raises(InvalidInputError):
        ToyConfig(hidden_size=0)
    with pytest.raises(InvalidInputError):
        trajectory("sft", 2)
    with pytest.raises(DtypeError):
        train(TINY, 1, dtype="int8")  # raised at the call, not at the first next()


def test_save_safetensors_roundtrips_bfloat16(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    state = trajectory("rl", 1)[-1]
    save_safetensors(state, tmp_path / "ckpt.safetensors")
    loaded = safetensors_numpy.load_file(str(tmp_path / "ckpt.safetensors"))
    assert list(loaded) == sorted(state)  # safetensors sorts names
    for name, arr in state.items():
        assert loaded[name].dtype == np.dtype(ml_dtypes.bfloat16)
        assert loaded[name].tobytes() == arr.tobytes()
