"""Whole checkpoint directories through a trajectory (tiny real transformers models, CPU, nothing downloaded):
config and tokenizer files kept with the step, and a Trainer checkpoint-N/ whose training resumes bit-exactly."""

from __future__ import annotations

import json
import warnings

import pytest

import ulstore
from tests.cli.test_cli import run
from tests.helpers.bits import assert_bits_equal
from tests.helpers.hf import tiny_bert_config
from tests.io.test_training_state import same
from ulstore import io as uio

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "the", "store", "keeps", "##s"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny BERT classifier and its tokenizer (from a generated vocab.txt), saved with save_pretrained."""
    d = tmp_path_factory.mktemp("hf")
    (d / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(d / "vocab.txt"))
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(tiny_bert_config(len(VOCAB), hidden_size=32))
    out = d / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def logits(path, text="the store keeps the steps"):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return ids["input_ids"], model(**ids).logits


def test_a_model_directory_round_trips_with_config_and_tokenizer(tmp_path, model_dir):
    small = sorted(p.name for p in model_dir.iterdir() if p.name != "model.safetensors")
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(small)
    url = tmp_path / "traj"
    p = run("add", url, model_dir, "--step", 1, "--init", check=0)
    assert f"kept {len(small)} files" in p.stdout and "config.json" in p.stdout
    traj = ulstore.open(url, mode="r")
    assert traj.files(1) == small
    run("export", url, 1, tmp_path / "restored", check=0)
    out = tmp_path / "restored"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    for name in small:  # every small file byte for byte
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    ids, want = logits(model_dir)
    got_ids, got = logits(out)
    assert_bits_equal(got_ids, ids, "token ids")
    assert_bits_equal(got, want, "logits")
    # a second step with the same config and tokenizer stores no file bytes again
    torch.manual_seed(1)
    nudged = transformers.BertForSequenceClassification.from_pretrained(model_dir)
    with torch.no_grad():
        nudged.classifier.weight.add_(1e-3)
    second = tmp_path / "second"
    nudged.save_pretrained(second)
    for name in small:
        if not (second / name).exists():
            (second / name).write_bytes((model_dir / name).read_bytes())
    run("add", url, second, "--step", 2, check=0)
    traj = ulstore.open(url, mode="r")
    assert traj.files(2) == small
    assert [traj.read_file(2, n) for n in small] == [traj.read_file(1, n) for n in small]
    docs = traj._reader.doc(1), traj._reader.doc(2)
    where = [{n: (d.packs[f.pack], f.offset) for n, f in d.files.items()} for d in docs]
    assert where[1] == where[0]  # content-addressed: step 2's files are step 1's bytes, not new copies
    rows = {r["step"]: r for r in uio.storage_report(traj)["steps"]}
    weights = sum(a.nbytes for a in traj.read(2).values())
    assert rows[2]["stored_bytes"] < 0.5 * weights  # a delta of the weights; the files cost nothing again


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A Trainer run of a tiny model to step 2 (checkpoint-2/ with optimizer.pt, scheduler.pt, rng_state.pth)."""
    d = tmp_path_factory.mktemp("trainer")
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, len(VOCAB), (8,), generator=g), "labels": torch.tensor(i % 2)} for i in range(32)
    ]

    def trainer(out, max_steps):
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(tiny_bert_config(len(VOCAB), hidden_size=32))
        args = transformers.TrainingArguments(
            output_dir=str(out),
            max_steps=max_steps,
            save_steps=2,
            per_device_train_batch_size=4,
            report_to=[],
            use_cpu=True,
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
        )
        return transformers.Trainer(model=model, args=args, train_dataset=data)

    trainer(d / "run", 2).train()
    return d / "run" / "checkpoint-2", trainer


def final_state(out):
    """Weights and optimizer state a resumed run saved at its last checkpoint (step 4)."""
    from ulstore.io import checkpoints

    ck = out / "checkpoint-4"
    weights = checkpoints.load(ck / "model.safetensors").tensors
    return weights, torch.load(ck / "optimizer.pt", weights_only=True)


@pytest.mark.slow
def test_a_trainer_checkpoint_round_trips_and_training_resumes_bit_exactly(tmp_path, trainer_run):
    ckpt, trainer = trainer_run
    url = tmp_path / "traj"
    p = run("add", url, ckpt, "--init", check=0)  # the step (2) from the directory name
    assert "optimizer state" in p.stdout
    traj = ulstore.open(url, mode="r")
    meta = traj.info(2).metadata["checkpoint"]
    assert set(meta["state"]) >= {"optimizer.pt", "scheduler.pt"}
    assert {"trainer_state.json", "training_args.bin", "rng_state.pth", "config.json"} <= set(traj.files(2))
    moments = [n for n in traj.tensors(2) if n.startswith("_state/optimizer.state.") and n.endswith("exp_avg")]
    assert moments and all(str(traj.tensors(2)[n][1]) == "float32" for n in moments)  # Adam moments as tensors
    run("export", url, 2, tmp_path / "checkpoint-2", check=0)
    out = tmp_path / "checkpoint-2"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ckpt.iterdir())
    for name in ("trainer_state.json", "training_args.bin", "rng_state.pth", "config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes(), name
    for name in meta["state"]:  # what torch.load returns: equal in values, dtypes, types and structure
        assert same(torch.load(out / name, weights_only=True), torch.load(ckpt / name, weights_only=True)), name
    # two runs resume for 2 more steps: from the original directory and from the export
    trainer(tmp_path / "a", 4).train(resume_from_checkpoint=str(ckpt))
    trainer(tmp_path / "b", 4).train(resume_from_checkpoint=str(out))
    (wa, oa), (wb, ob) = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert list(wa) == list(wb)
    for name in wa:
        assert_bits_equal(wb[name], wa[name], name)
    assert same(oa, ob)
    assert json.loads((tmp_path / "a" / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


def test_trainer_checkpoints_in_sequence_do_not_warn_but_another_model_does(tmp_path, trainer_run):
    """checkpoint-2/, checkpoint-4/ one after the other share every name with the step before (weights and
    optimizer state): no FewSharedNamesWarning (#38: it said "33% of parent's bytes", counting the parent's
    optimizer state but not the new checkpoint's); through Python and the CLI.  A genuinely different model
    still warns."""
    _, trainer = trainer_run
    trainer(tmp_path / "run", 4).train()
    ck2, ck4 = tmp_path / "run" / "checkpoint-2", tmp_path / "run" / "checkpoint-4"
    traj = ulstore.open(tmp_path / "py", mode="w")
    with warnings.catch_warnings():
        warnings.simplefilter("error", uio.FewSharedNamesWarning)
        assert uio.import_checkpoint(traj, ck2) == 2
        assert uio.import_checkpoint(traj, ck4) == 4
        # the weights alone after a checkpoint with optimizer state: all of it is delta-coded, nothing to warn
        uio.import_checkpoint(traj, ck4 / "model.safetensors", 5)
    assert any(n.startswith("_state/optimizer.") for n in traj.tensors(4))
    p = run("add", tmp_path / "cli", ck2, ck4, "--init", check=0)
    assert "warning" not in p.stderr.lower() and "stored whole" not in p.stderr, p.stderr
    # another model (other shapes): little of it can be delta-coded, and it says so
    torch.manual_seed(0)
    other = transformers.BertForSequenceClassification(tiny_bert_config(len(VOCAB), hidden_size=16))
    other.save_pretrained(tmp_path / "other")
    with pytest.warns(uio.FewSharedNamesWarning, match="stored whole") as caught:
        uio.import_checkpoint(traj, tmp_path / "other", 6)
    assert caught.list[0].message.shared < 0.01 and caught.list[0].message.parent == 5


def test_nested_torch_state_file_round_trips(tmp_path, monkeypatch):
    """A nested ``.pt`` training state in a directory: flattened in, rebuilt out, equal in types and bits."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    d = tmp_path / "ckpt-5"
    d.mkdir()
    from ulstore.io import checkpoints

    checkpoints.save_safetensors(
        {k: v.detach().numpy() for k, v in model.state_dict().items()}, d / "model.safetensors"
    )
    torch.save(opt.state_dict(), d / "optimizer.pt")
    (d / "notes.txt").write_text("epoch 3")
    traj = ulstore.open(tmp_path / "traj", mode="w")
    uio.import_checkpoint(traj, d)
    assert traj.files(5) == ["_state/optimizer.json", "notes.txt"]
    uio.export_checkpoint(traj, 5, tmp_path / "out")
    assert same(torch.load(tmp_path / "out" / "optimizer.pt", weights_only=True), opt.state_dict())
    assert (tmp_path / "out" / "notes.txt").read_text() == "epoch 3"
    # single-file exports hold the weights only
    uio.export_checkpoint(traj, 5, tmp_path / "w.safetensors")
    assert sorted(checkpoints.load(tmp_path / "w.safetensors").tensors) == ["bias", "weight"]
    # a file too large to keep is named, in a warning and in the step's metadata
    (d / "huge.bin").write_bytes(b"x" * 2000)
    big = tmp_path / "ckpt-7"
    big.mkdir()
    for f in d.iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr("ulstore.io._dirstate.MAX_FILE_BYTES", 1000)
    with pytest.warns(UserWarning, match=r"not kept .*huge.bin \(2000 bytes\)"):
        uio.import_checkpoint(traj, big)
    assert traj.info(7).metadata["checkpoint"]["not_kept"] == {"huge.bin": 2000} and "huge.bin" not in traj.files(7)
    # names under _state/ are reserved for training state
    bad = tmp_path / "ckpt-6"
    bad.mkdir()
    checkpoints.save_safetensors({"_state/x": model.weight.detach().numpy()}, bad / "model.safetensors")
    with pytest.raises(ulstore.InvalidInputError, match="reserved"):
        uio.import_checkpoint(traj, bad)
    assert 6 not in traj.steps
