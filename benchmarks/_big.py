"""A >= 200M-parameter bf16 model trained for real (toytrain, ~204M parameters), cached as safetensors.

``benchmarks/store.py`` measures the store on it.  The run: the "bench" preset
widened to hidden 2048 / intermediate 8192 (distinct tensors, no tiling), 20
warm-up AdamW steps at lr 1e-3, then ``steps`` RL-like steps at lr 3e-6, one
bf16 checkpoint after each.  Cached under ``$ULSTORE_BENCH_CACHE`` (default
``~/.cache/ulstore/benchmarks``: ``_data.cache_dir``) in ``store-204M-rl/``; rebuilt if the configuration or
toytrain changes.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ulstore import toytrain

__all__ = ["load_big", "CONFIG"]

CONFIG = dict(hidden_size=2048, intermediate_size=8192)
WARMUP, LR = 20, 3e-6


def _cache() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _data import _mark_ignored, _toytrain_digest, announce_cache, cache_dir

    announce_cache()
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    _mark_ignored(root)
    return root / "store-204M-rl", _toytrain_digest()  # type: ignore[return-value]


def load_big(steps: int) -> list[dict[str, np.ndarray]]:
    """``steps + 1`` consecutive bf16 checkpoints of the ~204M-parameter run (trained once, then read back).

    The run is trained for at least 12 steps, so that shorter requests reuse it.
    """
    from safetensors.numpy import load_file

    path, digest = _cache()
    cfg = toytrain.ToyConfig.preset("bench", **CONFIG)
    meta = {"config": asdict(cfg), "warmup": WARMUP, "lr": LR, "toytrain": digest}
    try:
        have = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        have = {}
    if have.get("checkpoints", 0) < steps + 1 or {k: v for k, v in have.items() if k != "checkpoints"} != meta:
        steps_trained = max(steps, 12)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        print(
            f"training {cfg.num_params / 1e6:.0f}M parameters: {WARMUP} warm-up + {steps_trained} steps ...",
            file=sys.stderr,
        )
        t0 = time.perf_counter()
        for step, state, _loss in toytrain.train(cfg, steps_trained, lr=LR, warmup_steps=WARMUP, dtype="bfloat16"):
            toytrain.save_safetensors(state, tmp / f"step-{step:04d}.safetensors")
            print(f"  checkpoint {step} at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        (tmp / "meta.json").write_text(json.dumps({**meta, "checkpoints": steps_trained + 1}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return [load_file(str(path / f"step-{i:04d}.safetensors")) for i in range(steps + 1)]


if __name__ == "__main__":
    states = load_big(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
    print(len(states), sum(v.size for v in states[0].values()) / 1e6, "M parameters")
