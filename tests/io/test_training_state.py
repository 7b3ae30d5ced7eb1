"""Training state beyond weights, in pure io (the store's per-step files come later): nested optimizer state
flattened and rebuilt exactly, and a real Trainer ``checkpoint-N/`` sorted into weights, state and files."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from tests.helpers.bits import assert_bits_equal
from ulstore.errors import InvalidInputError
from ulstore.io._hfdir import load_torch_state, sort_directory
from ulstore.io._nested import flatten_state, unflatten_state


def same(a, b) -> bool:
    """Equal in value *and* type, all the way down; tensors and arrays bit for bit; NaNs by their bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (np.ndarray, np.generic)) or type(a).__module__.startswith("torch"):
        try:
            assert_bits_equal(a, b)
        except AssertionError:
            return False
        return True
    return a == b


def test_nested_state_round_trips_with_exact_types():
    payload_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]
    state = {
        "state": {0: {"step": 7, "m": np.arange(4, dtype=np.float32)}, 1: {"m": np.zeros((2, 2), np.float64)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "amsgrad": False, "foreach": None, "params": [0, 1]}],
        "floats": [-0.0, math.inf, -math.inf, payload_nan, 5e-324],
        "numpy": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float16(np.nan)],
        "text": "adamw",
        "big": 2**70,
    }
    flat = flatten_state(state, prefix="optimizer")
    assert sorted(flat.tensors) == ["optimizer.state.0.m", "optimizer.state.1.m"]
    skeleton = json.loads(json.dumps(flat.skeleton))  # it travels as JSON
    back = unflatten_state(flat.tensors, skeleton)
    assert same(back, state)
    # the checker itself can tell the difference it is there to catch
    assert not same({1: 1}, {"1": 1}) and not same((1,), [1]) and not same(True, 1) and not same(0.0, -0.0)


def test_unstorable_leaves_and_clashing_names_are_refused():
    with pytest.raises(InvalidInputError, match="is a object"):
        flatten_state({"x": object()})
    with pytest.raises(InvalidInputError, match="flatten to the tensor name 'a.b'"):
        flatten_state({"a": {"b": np.ones(1, np.float32)}, "a.b": np.ones(1, np.float32)})
    with pytest.raises(InvalidInputError, match="version"):
        unflatten_state({}, {"version": 99, "root": None})


def test_adamw_state_restores_and_training_resumes_bit_exactly():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(6)]

    def step(m, o, batch):
        loss = torch.nn.functional.mse_loss(m(batch[0]), batch[1])
        o.zero_grad()
        loss.backward()
        o.step()

    for batch in data[:3]:
        step(model, opt, batch)
    flat = flatten_state(opt.state_dict(), prefix="optimizer")
    moments = [n for n in flat.tensors if n.endswith("exp_avg")]
    assert len(moments) == 4 and all(flat.tensors[n].dtype == torch.float32 for n in moments)
    # the tensors through a trajectory (ULPack-coded, read back fresh), the skeleton through JSON
    import ulstore
    from ulstore.io import checkpoints

    traj = ulstore.open("memory://training-state-adamw", mode="w")
    traj.commit(3, flat.tensors, metadata={"optimizer": flat.skeleton})
    restored_tensors = checkpoints.to_torch(traj.read(3))
    restored = unflatten_state(restored_tensors, traj.info(3).metadata["optimizer"])
    assert same(restored, opt.state_dict())

    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.01)
    twin_opt.load_state_dict(restored)
    for batch in data[3:]:
        step(model, opt, batch)
        step(twin, twin_opt, batch)
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert_bits_equal(a, b, name)


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory):
    """A real ``checkpoint-2/`` written by transformers' Trainer for a tiny model (built from a config)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("trainer")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(d), max_steps=2, save_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True
    )
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return d / "checkpoint-2"


def test_trainer_checkpoint_is_sorted_into_weights_state_and_files(trainer_checkpoint):
    torch = pytest.importorskip("torch")
    parts = sort_directory(trainer_checkpoint)
    assert parts.weights == ["model.safetensors"]
    assert "optimizer.pt" in parts.torch_state
    assert {"config.json", "trainer_state.json", "training_args.bin"} <= set(parts.files)
    assert parts.too_large == {}
    for name, data in parts.files.items():
        assert data == (trainer_checkpoint / name).read_bytes()
    assert json.loads(parts.files["trainer_state.json"])["global_step"] == 2
    # the optimizer state: its tensors are the Adam moments, fp32, one pair per parameter
    flat = load_torch_state(trainer_checkpoint / "optimizer.pt")
    assert all(n.startswith("optimizer.state.") for n in flat.tensors)
    assert {t.dtype for t in flat.tensors.values()} == {torch.float32}
    original = torch.load(trainer_checkpoint / "optimizer.pt", weights_only=True)
    assert same(unflatten_state(flat.tensors, json.loads(json.dumps(flat.skeleton))), original)
    # a file that is too large is reported, not read
    small = sort_directory(trainer_checkpoint, max_file_bytes=100)
    assert "training_args.bin" in small.too_large and "training_args.bin" not in small.files
