"""A MoE-shaped bf16 model (~11,000 tensors, ~1.2 GB) and RL-regime steps of it, cached as safetensors.

``benchmarks/store.py --only moe`` measures the store on it (issue 39: many tensors).  The layout is
Qwen3-30B-A3B's (``model.layers.N.mlp.experts.E.{gate,up,down}_proj``, a router ``mlp.gate``, GQA
attention with ``q_norm``/``k_norm``, two RMSNorms a layer, embeddings and an untied ``lm_head``), with
its 128 experts a layer and its ratios (expert intermediate = 0.375 x hidden, 8 query heads per
key/value head group down to 3 here), scaled to hidden 384 and 28 layers so that a step is ~1.2 GB:
expert projections are 110 KB each, attention 98-295 KB, routers 98 KB, embeddings 7.9 MB; norms are
the few small tensors (768 B and 128 B), as in the real model.

Weights are not trained (training 600M parameters on this machine would take hours): step 0 is
fp32 master weights drawn per tensor (normal, std 0.02, or around 1 for norms), rounded to bf16;
each later step adds an Adam-like update of the same absolute size to every master weight
(``lr * N(0, 1)``, the size of ``m / sqrt(v)`` times the learning rate) and rounds again.  An
element's bf16 value changes only where the update crosses a rounding boundary, so small-exponent
weights change more often and by more ULPs than large ones, as in real RL steps; ``lr`` is
calibrated so that 1.65% of the elements change per step (the measured RL regime: 1.5-1.8%).

Cached under ``$ULSTORE_BENCH_CACHE`` (``_data.cache_dir``) in ``moe-<digest>/``; rebuilt when
this generator's configuration or this file changes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["CONFIG", "layout", "load_moe"]

CONFIG = dict(
    hidden=384, layers=28, experts=128, expert_inter=144, heads=6, kv_heads=2, head_dim=64, vocab=10240, seed=39
)
#: fraction of elements that change per step (the RL regime of issue 39: 1.5-1.8%)
TARGET_CHANGED = 0.0165
BF16 = np.dtype(ml_dtypes.bfloat16)


def layout(cfg: dict = CONFIG) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, in Qwen3-MoE's naming (safetensors order: sorted by name)."""
    h, inter, hd = cfg["hidden"], cfg["expert_inter"], cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab"], h),
        "lm_head.weight": (cfg["vocab"], h),
        "model.norm.weight": (h,),
    }
    for layer in range(cfg["layers"]):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (cfg["heads"] * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg["kv_heads"] * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg["kv_heads"] * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg["heads"] * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate.weight"] = (cfg["experts"], h)  # the router
        for e in range(cfg["experts"]):
            q = p + f"mlp.experts.{e}."
            shapes[q + "gate_proj.weight"] = (inter, h)
            shapes[q + "up_proj.weight"] = (inter, h)
            shapes[q + "down_proj.weight"] = (h, inter)
    return dict(sorted(shapes.items()))


def _init(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """fp32 master weights: norms near 1 (trained norms spread around it), the rest N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return 0.02 * rng.standard_normal(shape, dtype=np.float32)


def _changed(lr: float, cfg: dict) -> float:
    """Fraction of bf16 elements one update of size ``lr`` changes, on a sample of the model's tensors."""
    rng = np.random.default_rng(cfg["seed"] + 1)
    shapes = layout(cfg)
    names = sorted(shapes)[:: max(1, len(shapes) // 200)]
    changed = total = 0
    for n in names:
        w = _init(n, shapes[n], rng)
        w2 = w + np.float32(lr) * rng.standard_normal(w.shape, dtype=np.float32)
        changed += int(np.count_nonzero(w.astype(BF16).view(np.uint16) != w2.astype(BF16).view(np.uint16)))
        total += w.size
    return changed / total


def _calibrate(cfg: dict) -> float:
    """The update size that changes ``TARGET_CHANGED`` of the elements (the fraction is ~linear in it)."""
    lr = 1e-6
    for _ in range(4):
        lr *= TARGET_CHANGED / max(_changed(lr, cfg), 1e-9)
    return lr


def _digest(cfg: dict) -> str:
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(Path(__file__).read_bytes())
    h.update(np.__version__.encode())
    return h.hexdigest()[:12]


def _build(path: Path, checkpoints: int, cfg: dict) -> None:
    from safetensors.numpy import save_file

    lr = _calibrate(cfg)
    shapes = layout(cfg)
    print(
        f"generating the MoE model: {len(shapes):,} tensors, {sum(map(np.prod, shapes.values())) / 1e6:.0f}M "
        f"parameters, {checkpoints} checkpoints (update size {lr:.3g}) ...",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    steps: list[dict[str, np.ndarray]] = [{} for _ in range(checkpoints)]
    for i, (name, shape) in enumerate(shapes.items()):
        rng = np.random.default_rng([cfg["seed"], i])
        w = _init(name, shape, rng)
        for k in range(checkpoints):
            if k:
                w += np.float32(lr) * rng.standard_normal(shape, dtype=np.float32)
            steps[k][name] = w.astype(BF16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k, state in enumerate(steps):
        save_file(state, str(tmp / f"step-{k:04d}.safetensors"))
    (tmp / "meta.json").write_text(json.dumps({"config": cfg, "lr": lr, "checkpoints": checkpoints}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    print(f"  generated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def load_moe(steps: int, cfg: dict = CONFIG) -> list[dict[str, np.ndarray]]:
    """``steps + 1`` consecutive bf16 checkpoints of the MoE model (generated once, then read back)."""
    from _data import _mark_ignored, announce_cache, cache_dir
    from safetensors.numpy import load_file

    announce_cache()
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    _mark_ignored(root)
    path = root / f"moe-{_digest(cfg)}"
    try:
        have = json.loads((path / "meta.json").read_text())["checkpoints"]
    except (OSError, ValueError, KeyError):
        have = 0
    if have < steps + 1:
        _build(path, max(steps + 1, 4), cfg)
    return [load_file(str(path / f"step-{i:04d}.safetensors")) for i in range(steps + 1)]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    states = load_moe(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    a, b = states[0], states[1]
    changed = sum(int(np.count_nonzero(a[n].view(np.uint16) != b[n].view(np.uint16))) for n in a)
    sizes = [v.nbytes for v in a.values()]
    print(
        f"{len(states)} checkpoints, {len(a):,} tensors, {sum(sizes) / 1e9:.2f} GB a step "
        f"({sum(s >= 100_000 for s in sizes):,} of 0.1-8 MB, largest {max(sizes) / 1e6:.1f} MB); "
        f"{100 * changed / sum(v.size for v in a.values()):.2f}% of elements changed step 0 -> 1"
    )
