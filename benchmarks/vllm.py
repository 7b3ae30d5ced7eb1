"""vLLM weight sync through the ``ulstore`` backend against the alternatives, per version, on a real RL run.

A Llama-style causal LM (default ~134M parameters: 12 layers, hidden 768,
vocab 32000; ``--small`` for a smoke run) is trained for real (fp32 master
weights, AdamW, a short warm-up at 1e-3, then lr 3e-6) and each step is
published in bf16.  One vLLM engine (CPU, bf16) with the ``ulstore`` backend
follows it.  Per version this prints:

- **trainer**, the time the trainer is blocked: ``Publisher.publish`` (today
  blocking: encode + write; ``Publisher.submit`` will return after a
  snapshot), against ``safetensors.save_file`` of the same bf16 state and
  against writing a TRL-style int32 sparse file (change mask against the
  previous bf16 state, int32 indices + bf16 values, one safetensors file);
- **bytes**: the version's ulstore blobs (what a follower downloads: its pack
  range and step document), the TRL int32 file, the full safetensors file;
- **engine**, the time in the worker: the ``ulstore`` update (read, verify,
  write in place), vLLM's full ``load_weights`` of the state (tensors already
  in memory), ``load_checkpoint_weight_patches`` with the same changes (int64
  indices, tensors in memory), and a TRL-style sparse load (read the int32
  file, scatter into a host copy of the previous version, ``load_weights`` of
  each touched tensor); each also with its bytes downloaded at 1 GB/s.

Every alternative writes the same version's values, so the engine stays on
the version the follower holds.  Run from the repository root with the vllm
extra (``python benchmarks/vllm.py``; ~10 min on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# this file is named vllm.py: its directory must not shadow the vllm package; the repository root provides tests.*
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

GB_S = 1e9  # the download rate every method is charged at


def trl_file(prev: dict, state: dict, path: Path) -> tuple[dict, float]:
    """Write TRL's first sparse format (``<name>.indices`` int32, ``<name>.values``) of the changes; returns the
    patches (int64 indices, for vLLM) and the seconds taken (mask, gather, write)."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    out, patches = {}, {}
    for n, t in state.items():
        changed = (t.view(torch.int16) != prev[n].view(torch.int16)).view(-1).nonzero().view(-1)
        if changed.numel():
            out[f"{n}.indices"] = changed.to(torch.int32)
            out[f"{n}.values"] = t.view(-1)[changed]
            patches[n] = (changed, out[f"{n}.values"])
    save_file(out, str(path))
    return patches, time.perf_counter() - t0


def _worker_full_load(worker, path):
    import time

    from safetensors.torch import load_file

    tensors = load_file(path)
    model = worker.model_runner.get_model()
    t0 = time.perf_counter()
    model.load_weights(iter(tensors.items()))
    return time.perf_counter() - t0


def _worker_patches(worker, path):
    import time

    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    f = load_file(path)
    shapes = worker._bench_shapes
    patches = [
        CheckpointWeightPatch(n, shapes[n], torch.bfloat16, f[f"{n}.values"], f[f"{n}.indices"].to(torch.int64))
        for n in shapes
        if f"{n}.indices" in f
    ]
    model = worker.model_runner.get_model()
    t0 = time.perf_counter()
    load_checkpoint_weight_patches(model, patches)
    return time.perf_counter() - t0


def _worker_trl(worker, path):
    """TRL-style: read the file, scatter into the host copy, load the touched tensors through load_weights."""
    import time

    from safetensors.torch import load_file

    t0 = time.perf_counter()
    f = load_file(path)
    host = worker._bench_host
    touched = []
    for n in host:
        if f"{n}.indices" in f:
            host[n].view(-1).index_copy_(0, f[f"{n}.indices"].long(), f[f"{n}.values"])
            touched.append(n)
    worker.model_runner.get_model().load_weights((n, host[n]) for n in touched)
    return time.perf_counter() - t0


def _worker_setup(worker, path):
    from safetensors.torch import load_file

    worker._bench_host = {n: t.clone() for n, t in load_file(path).items()}
    worker._bench_shapes = {n: tuple(t.shape) for n, t in worker._bench_host.items()}
    return sum(t.numel() for t in worker._bench_host.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="a 2M-parameter model: a smoke run")
    ap.add_argument("--trust-state", action="store_true", help="engines skip the follower's rotating re-check")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of this script's functions

    import torch
    import vllm
    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from tests.integrations._tiny_lm import TinyTrainer, write_hf_dir
    from ulstore.integrations.vllm.trainer import LLMClient, UlstoreTrainer, UlstoreTrainerInitInfo

    work = Path(args.dir or tempfile.mkdtemp(prefix="ulstore-vllm-bench-"))
    sizes = (
        {}
        if args.small
        else dict(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12
        )
    )
    trainer = TinyTrainer("llama", seed=0, warmup_steps=3, **sizes)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    prev = trainer.state(torch.bfloat16)
    start_dir = write_hf_dir(work / "start", trainer.config, prev, torch.bfloat16)
    llm = LLM(
        str(start_dir),
        dtype=torch.bfloat16,
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,
        weight_transfer_config=WeightTransferConfig(backend="ulstore"),
    )
    llm.collective_rpc(_worker_setup, args=(str(start_dir / "model.safetensors"),))
    info0 = UlstoreTrainerInitInfo(rank=0, url=str(work / "bucket"), anchor_every=1000, trust_state=args.trust_state)
    sync = UlstoreTrainer.trainer_init(info0, client=LLMClient(llm))
    sync.send_weights(prev, 0)  # the engine's bootstrap: the whole model once
    full_bytes = (start_dir / "model.safetensors").stat().st_size
    print(
        f"Llama-style model: {n_params / 1e6:.1f}M parameters, bf16 {full_bytes / 1e6:.1f} MB; vLLM {vllm.__version__}"
    )
    head = (
        f"{'v':>2} {'changed':>7} | {'publish':>8} {'st save':>8} {'TRL int32':>9} | {'ulstore':>9} {'TRL int32':>9} "
        f"{'full':>9} | {'ulstore':>8} {'+dl':>8} {'load_w':>8} {'+dl':>8} {'patches':>8} {'+dl':>8} {'TRL':>8} "
        f"{'+dl':>8}"
    )
    print("trainer blocking (s) | bytes per version (MB) | engine update (s), +dl = with download at 1 GB/s")
    print(head)
    for v in range(1, args.versions + 1):
        trainer.step()
        state = trainer.state(torch.bfloat16)
        t0 = time.perf_counter()
        info = sync.publisher.publish(v, state)  # (blocking today; Publisher.submit will return after a snapshot)
        t_pub = time.perf_counter() - t0
        full = work / f"v{v}.safetensors"
        t0 = time.perf_counter()
        save_file(state, str(full))
        t_st = time.perf_counter() - t0
        trl = work / f"v{v}.trl.safetensors"
        patches, t_trl = trl_file(prev, state, trl)
        changed = sum(i.numel() for i, _ in patches.values()) / n_params
        sync.notify(info.version, info.document)
        ours = llm.collective_rpc(lambda w: w.weight_transfer_engine.last_update_seconds)[0]
        b_ours = info.delta_bytes + len(info.document)
        b_trl = trl.stat().st_size
        t_full = llm.collective_rpc(_worker_full_load, args=(str(full),))[0]
        t_patch = llm.collective_rpc(_worker_patches, args=(str(trl),))[0]
        t_trl_load = llm.collective_rpc(_worker_trl, args=(str(trl),))[0]
        print(
            f"{v:>2} {changed:>7.2%} | {t_pub:>8.3f} {t_st:>8.3f} {t_trl:>9.3f} | {b_ours / 1e6:>9.2f} "
            f"{b_trl / 1e6:>9.2f} {full_bytes / 1e6:>9.2f} | {ours:>8.3f} {ours + b_ours / GB_S:>8.3f} "
            f"{t_full:>8.3f} {t_full + full_bytes / GB_S:>8.3f} {t_patch:>8.3f} {t_patch + b_trl / GB_S:>8.3f} "
            f"{t_trl_load:>8.3f} {t_trl_load + b_trl / GB_S:>8.3f}",
            flush=True,
        )
        prev = state
        full.unlink()
    sync.shutdown()
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
