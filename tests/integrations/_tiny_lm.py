"""Tiny Llama- and Qwen-style causal LMs trained for real (transformers, fp32 master weights, AdamW), for the vLLM
tests and benchmark: a warm-up at a high learning rate, then RL-regime steps at about 3e-6, each step's weights
cast to the serving dtype and published."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["TinyTrainer", "config_of", "write_hf_dir", "fused_expected"]

#: head_dim 64 (the CPU attention backend refuses 16); GQA with one kv head; 2 layers
SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)


def config_of(kind: str, **sizes):
    """A transformers config: ``llama`` (untied head) or ``qwen`` (Qwen2, tied embeddings, qkv biases)."""
    import transformers

    s = {**SIZES, **sizes}
    heads = s["num_attention_heads"]
    common = dict(num_key_value_heads=max(1, heads // 2), max_position_embeddings=512, rms_norm_eps=1e-6, **s)
    if kind == "llama":
        return transformers.LlamaConfig(head_dim=s["hidden_size"] // heads, tie_word_embeddings=False, **common)
    if kind == "qwen":
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    raise ValueError(kind)


class TinyTrainer:
    """A causal LM learning a fixed synthetic language (repeating token motifs) with AdamW.

    ``step()`` takes one optimizer step; ``state(dtype)`` is the published state: every parameter once (a tied
    head is the embedding, as HF checkpoints store it), cast to ``dtype``.
    """

    def __init__(self, kind: str = "llama", *, seed: int = 0, lr: float = 3e-6, warmup_steps: int = 20, **sizes):
        import transformers

        torch.manual_seed(seed)
        self.kind = kind
        self.config = config_of(kind, **sizes)
        cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
        self.model = cls(self.config).float()
        self.gen = torch.Generator().manual_seed(seed + 1)
        motifs = torch.randint(3, self.config.vocab_size, (16, 8), generator=self.gen)
        self.motifs = motifs
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        for _ in range(warmup_steps):  # stand-in for pre-training: weights leave their initialisation
            self.step()
        for group in self.opt.param_groups:
            group["lr"] = lr

    def batch(self, n: int = 4, length: int = 32) -> torch.Tensor:
        pick = torch.randint(0, len(self.motifs), (n, length // self.motifs.shape[1]), generator=self.gen)
        return self.motifs[pick].reshape(n, -1)

    def step(self) -> float:
        x = self.batch()
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(dtype).clone() for n, p in self.model.named_parameters()}


def write_hf_dir(path, config, state: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """An HF model directory vLLM starts from: ``config.json`` (with ``architectures``) and, if given,
    ``model.safetensors`` of ``state``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM" if config.model_type == "llama" else "Qwen2ForCausalLM"]
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if state is not None:
        save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    return path


def fused_expected(state: dict, config, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """What vLLM's Llama/Qwen2 parameters hold for checkpoint ``state``, written out by hand (the fusing rules
    and TP slicing vLLM documents): an expectation independent of the loader observation.  Keys are vLLM
    parameter names; the vocabulary-padded rows of the embedding and head are left out (compared on ``[:vocab]``
    of the rank's rows)."""
    out = {}
    layers = config.num_hidden_layers

    def rows(t, parts):  # this rank's slice of each part along dim 0, concatenated
        return torch.cat([p.chunk(tp, 0)[rank] for p in parts])

    for i in range(layers):
        p = f"model.layers.{i}."
        q, k, v = (state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
        out[f"{p}self_attn.qkv_proj.weight"] = rows(None, [q, k, v])
        if f"{p}self_attn.q_proj.bias" in state:
            out[f"{p}self_attn.qkv_proj.bias"] = rows(None, [state[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"])
        out[f"{p}self_attn.o_proj.weight"] = state[f"{p}self_attn.o_proj.weight"].chunk(tp, 1)[rank]
        g, u = state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]
        out[f"{p}mlp.gate_up_proj.weight"] = rows(None, [g, u])
        out[f"{p}mlp.down_proj.weight"] = state[f"{p}mlp.down_proj.weight"].chunk(tp, 1)[rank]
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{n}.weight"] = state[f"{p}{n}.weight"]
    out["model.norm.weight"] = state["model.norm.weight"]
    out["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].chunk(tp, 0)[rank]
    if "lm_head.weight" in state:
        out["lm_head.weight"] = state["lm_head.weight"].chunk(tp, 0)[rank]
    return out
