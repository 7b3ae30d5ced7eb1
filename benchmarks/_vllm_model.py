"""A Llama-style causal LM that vLLM loads, trained for real in the RL regime, its bf16 versions cached.

``benchmarks/vllm.py`` needs versions of a model vLLM serves, with the changes a
real RL run makes.  This trains a ``transformers.LlamaForCausalLM`` in fp32
master weights with AdamW on real text (the standard-library sources of
:func:`ulstore.toytrain.corpus`, as the other benchmarks): a short warm-up at
lr 1e-3 takes the weights away from their initialisation, then one optimizer
step at lr 3e-6 per version.  Version 0 is the state after the warm-up (the
engine starts on it); each version is the bf16 round-to-nearest cast of the
master weights.

Tokens are byte pairs folded into the vocabulary (``(256 * a + b) % vocab``):
no tokenizer to download, and most rows of the embedding and head are used.

Cache (``$ULSTORE_BENCH_CACHE``, default ``~/.cache/ulstore/benchmarks``; the
other benchmarks' ``--clean`` removes it too)::

    vllm/<preset>-<key>/hf/config.json, hf/model.safetensors   version 0, an HF directory vLLM starts from
    vllm/<preset>-<key>/step-NNNN.safetensors                   every version, 0 included
    vllm/<preset>-<key>/meta.json

``<key>`` digests what determines the bytes (config, schedule, :data:`RECIPE`,
torch and transformers versions, the training text); a directory with fewer
versions than asked for is trained again from scratch, written under a
temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["PRESETS", "Versions", "load_versions", "num_params", "changed_fraction"]

#: Llama configs: head_dim 64 (the CPU attention backend refuses less); ``tiny`` ~6M for smoke runs,
#: ``bench`` ~134M (12 layers, hidden 768, vocab 32000, untied head)
PRESETS = {
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4),
    "bench": dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12
    ),
}
#: (warm-up steps at WARMUP_LR, sequences per batch, tokens per sequence)
SCHEDULE = {"tiny": (10, 4, 128), "bench": (5, 4, 128)}
WARMUP_LR = 1e-3
LR = 3e-6  # the RL regime: most bf16 weights do not change from one version to the next
SEED = 0
#: bump when the training recipe below changes the bytes (the cache key does not hash this file: editing the
#: benchmark must not throw away a trained run)
RECIPE = 1


def _config(preset: str):
    import transformers

    s = PRESETS[preset]
    return transformers.LlamaConfig(
        **s,
        num_key_value_heads=s["num_attention_heads"],
        head_dim=s["hidden_size"] // s["num_attention_heads"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def num_params(preset: str) -> int:
    """Parameters of ``preset`` (computed from its config, no model built)."""
    s = PRESETS[preset]
    h, i, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    return 2 * v * h + n * (4 * h * h + 3 * h * i + 2 * h) + h


def _tokens(vocab: int) -> np.ndarray:
    from ulstore import toytrain

    data = toytrain.corpus().astype(np.int64)
    data = data[: data.size // 2 * 2].reshape(-1, 2)
    return (data[:, 0] * 256 + data[:, 1]) % vocab


def _key(preset: str) -> dict:
    import torch
    import transformers

    from ulstore import toytrain

    return {
        "format": 1,
        "preset": preset,
        "config": PRESETS[preset],
        "schedule": SCHEDULE[preset],
        "warmup_lr": WARMUP_LR,
        "lr": LR,
        "seed": SEED,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "recipe": RECIPE,
        "text": hashlib.sha256(toytrain.corpus().tobytes()).hexdigest()[:16],
    }


def _run_dir(preset: str) -> Path:
    from benchmarks._data import cache_dir

    digest = hashlib.sha256(json.dumps(_key(preset), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "vllm" / f"{preset}-{digest}"


def _step_file(i: int) -> str:
    return f"step-{i:04d}.safetensors"


def _cached(path: Path) -> int:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return 0
    n = int(meta.get("versions", 0))
    files = [path / _step_file(i) for i in range(n)] + [path / "hf" / "config.json"]
    return n if all(f.is_file() for f in files) else 0


def _train(preset: str, versions: int, out: Path) -> None:
    """Train ``versions`` versions of ``preset`` into ``out`` (version 0 after the warm-up)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    config = _config(preset)
    model = transformers.LlamaForCausalLM(config).float().train()
    tokens = torch.from_numpy(_tokens(config.vocab_size))
    warm, n_seq, length = SCHEDULE[preset]
    gen = torch.Generator().manual_seed(SEED + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)

    def step() -> float:
        starts = torch.randint(0, tokens.numel() - length, (n_seq,), generator=gen)
        x = torch.stack([tokens[s : s + length] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for i in range(warm):
        _log(f"  warm-up step {i + 1}/{warm}: loss {step():.3f}")
    for group in opt.param_groups:
        group["lr"] = LR
    for v in range(versions):
        if v:
            _log(f"  RL step {v}/{versions - 1}: loss {step():.3f}")
        state = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
        save_file(state, str(out / _step_file(v)))
    hf = out / "hf"
    hf.mkdir()
    cfg = config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg, indent=1))
    os.link(out / _step_file(0), hf / "model.safetensors")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Versions:
    """The cached run: ``hf`` (version 0 as an HF directory), ``path(v)`` and ``state(v)`` (bf16 torch tensors)."""

    def __init__(self, root: Path, count: int):
        self.root, self.count = root, count
        self.hf = root / "hf"

    def path(self, v: int) -> Path:
        return self.root / _step_file(v)

    def state(self, v: int) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.path(v)))


def load_versions(preset: str, versions: int) -> Versions:
    """``versions`` cached versions of ``preset`` (0 .. versions-1), trained first if they are not."""
    root = _run_dir(preset)
    if _cached(root) >= versions:
        _log(f"versions cached in {root}")
        return Versions(root, versions)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    _log(f"training {preset!r} ({num_params(preset) / 1e6:.0f}M params, {versions} versions) into {root} ...")
    try:
        _train(preset, versions, tmp)
        (tmp / "meta.json").write_text(json.dumps({**_key(preset), "versions": versions}, indent=1) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"trained in {time.perf_counter() - t0:.0f} s")
    return Versions(root, versions)


def changed_fraction(a: dict, b: dict) -> float:
    """Fraction of elements whose bits differ between two states."""
    n = sum(t.numel() for t in a.values())
    diff = sum(int((a[k].view(-1).view(_int(a[k])) != b[k].view(-1).view(_int(a[k]))).sum()) for k in a)
    return diff / n if n else math.nan


def _int(t):
    import torch

    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
