"""Real Hugging Face models (tiny, built from configs; nothing downloaded): renamed tensors and sharded layouts."""

from __future__ import annotations

import json
import warnings

import pytest

import ulstore
from tests.cli.test_cli import run
from tests.helpers.bits import assert_bits_equal
from tests.helpers.hf import tiny_bert_config
from ulstore import io as uio
from ulstore.io import checkpoints as ckpt

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory):
    """A base BertModel (keys ``embeddings.*``) and a classifier fine-tuned from it (keys ``bert.embeddings.*``).

    Both are saved in bf16, as checkpoints usually are.  The fine-tune takes three AdamW steps
    (fp32 master weights) on a toy task, so that its weights have moved a little from the base, as
    in a real fine-tune; the base is also saved sharded, as ``save_pretrained`` shards.
    """
    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    base = transformers.BertModel(tiny_bert_config()).to(torch.bfloat16)
    base.save_pretrained(d / "base")
    base.save_pretrained(d / "base-sharded", max_shard_size="50KB")
    tuned = transformers.BertForSequenceClassification(tiny_bert_config())
    tuned.bert.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
    opt = torch.optim.AdamW(tuned.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 512, (8, 16), generator=g)
        loss = tuned(input_ids=ids, labels=torch.randint(0, 2, (8,), generator=g)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    tuned.to(torch.bfloat16).save_pretrained(d / "tuned")
    return d


def stored_bytes(traj, step) -> int:
    return next(r["stored_bytes"] for r in uio.storage_report(traj)["steps"] if r["step"] == step)


def test_renamed_tensors_warn_and_rename_prefix_restores_the_savings(tmp_path, bert_dirs):
    base, tuned = bert_dirs / "base", bert_dirs / "tuned"
    base_names = set(ckpt.load(base).tensors)
    tuned_file = ckpt.load(tuned)
    assert "embeddings.word_embeddings.weight" in base_names
    assert "bert.embeddings.word_embeddings.weight" in tuned_file.tensors  # the same tensor, another name

    plain = ulstore.open(tmp_path / "plain", mode="w")
    uio.import_checkpoint(plain, base, 0)
    with pytest.warns(uio.FewSharedNamesWarning) as caught:
        uio.import_checkpoint(plain, tuned, 1)
    (w,) = caught.list
    assert w.message.shared == 0.0 and w.message.suggestion == {"bert.": ""}
    assert w.message.suggested_shared == 1.0 and "rename_prefix={'bert.': ''}" in str(w.message)

    renamed = ulstore.open(tmp_path / "renamed", mode="w")
    uio.import_checkpoint(renamed, base, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", uio.FewSharedNamesWarning)  # lined up: no warning
        uio.import_checkpoint(renamed, tuned, 1, rename_prefix={"bert.": ""})
    assert "embeddings.word_embeddings.weight" in renamed.tensors(1)
    # delta-coded against the base: a fraction of what the same step costs with unmatched names
    with_names, without = stored_bytes(renamed, 1), stored_bytes(plain, 1)
    assert with_names < 0.6 * without, (with_names, without)

    # export gives the file back: its names, its tensor bytes, its metadata, its bytes
    out = tmp_path / "out"
    uio.export_checkpoint(renamed, 1, out)
    back = ckpt.load(out)
    assert list(back.tensors) == list(tuned_file.tensors) and back.metadata == tuned_file.metadata
    for name, arr in tuned_file.tensors.items():
        assert_bits_equal(back.tensors[name], arr, name)
    assert (out / "model.safetensors").read_bytes() == (tuned / "model.safetensors").read_bytes()
    # the exported weights load into the model class they came from, same logits
    model = transformers.BertForSequenceClassification.from_pretrained(tuned).eval()
    assert model.dtype == torch.bfloat16
    sd = uio.to_torch(renamed, 1)
    again = transformers.BertForSequenceClassification(tiny_bert_config()).to(torch.bfloat16).eval()
    again.load_state_dict(sd)
    ids = torch.arange(32).reshape(2, 16)
    with torch.no_grad():
        assert_bits_equal(again(input_ids=ids).logits, model(input_ids=ids).logits, "logits")


def test_rename_prefix_on_the_command_line(tmp_path, bert_dirs):
    url = tmp_path / "traj"
    run("add", url, bert_dirs / "base", "--step", 0, "--init", check=0)
    p = run("add", url, bert_dirs / "tuned", "--step", 1, check=0)
    (warning,) = [ln for ln in p.stderr.splitlines() if ln.startswith("ulstore: warning:")]
    assert "match 0% of parent step 0's bytes" in warning and "`--rename-prefix bert.=` would match 100%" in warning
    p = run("add", url, bert_dirs / "tuned", "--step", 2, "--parent", 0, "--branch", "cls", "--rename-prefix", "bert.=")
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr
    traj = ulstore.open(url, mode="r")
    assert stored_bytes(traj, 2) < 0.6 * stored_bytes(traj, 1)
    run("export", url, 2, tmp_path / "out", check=0)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        bert_dirs / "tuned" / "model.safetensors"
    ).read_bytes()
    # a prefix that matches nothing is an error, and nothing is committed
    p = run("add", url, bert_dirs / "tuned", "--step", 3, "--rename-prefix", "roberta.=")
    assert p.returncode == 1 and "'roberta.' matches no tensor name" in p.stderr
    assert 3 not in ulstore.open(url, mode="r").steps


def test_sharded_export_reproduces_the_layout_and_index_bytes(tmp_path, bert_dirs):
    src = bert_dirs / "base-sharded"
    index_bytes = (src / "model.safetensors.index.json").read_bytes()
    index = json.loads(index_bytes)
    assert isinstance(index["metadata"]["total_parameters"], int) and len(set(index["weight_map"].values())) > 2
    url = tmp_path / "traj"
    run("add", url, src, "--step", 7, "--init", check=0)
    run("export", url, 7, tmp_path / "out", check=0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in src.iterdir())
    assert (tmp_path / "out" / "model.safetensors.index.json").read_bytes() == index_bytes
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()  # a step file
    for shard in sorted(set(index["weight_map"].values())):
        want, got = ckpt.load_safetensors(src / shard), ckpt.load_safetensors(tmp_path / "out" / shard)
        assert list(got.tensors) == list(want.tensors) and got.metadata == want.metadata
        for name, arr in want.tensors.items():
            assert_bits_equal(got.tensors[name], arr, f"{shard}: {name}")
        assert (tmp_path / "out" / shard).read_bytes() == (src / shard).read_bytes()
    # resharding keeps the index's metadata and its JSON types; only total_size is recomputed
    run("export", url, 7, tmp_path / "re", "--shard-size", "200KB", check=0)
    re_index = json.loads((tmp_path / "re" / "model.safetensors.index.json").read_text())
    assert re_index["metadata"] == index["metadata"]
    assert set(re_index["weight_map"]) == set(index["weight_map"])
    # and the model loads from the export
    model = transformers.BertModel.from_pretrained(tmp_path / "out")
    ref = transformers.BertModel.from_pretrained(src)
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert_bits_equal(a, b, n)
    assert_bits_equal(
        ckpt.load(tmp_path / "re").tensors["embeddings.word_embeddings.weight"],
        ckpt.load(src).tensors["embeddings.word_embeddings.weight"],
    )
