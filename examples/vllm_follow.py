"""A vLLM engine follows a training run through a ulstore bucket (the ``ulstore`` weight-transfer backend).

    pip install -e '.[vllm]'        # from the checkout (ulstore is not on the package index)
    python examples/vllm_follow.py --steps 3

A tiny Llama-style model trains in this process (fp32 master weights, AdamW);
every step is published in bf16 to a bucket (a local directory here; any
fsspec URL, e.g. ``s3://...``, with ``--bucket``), and a vLLM engine started
with ``weight_transfer_config=WeightTransferConfig(backend="ulstore")`` moves
to each version in place: only the changed elements are written into its
(fused) parameters.  Each step prints the version the engine reports and its
greedy continuation of a prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def tiny_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention needs head_dim >= 64
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config)


def hf_dir(model, path: Path) -> Path:
    """What vLLM starts from: config.json (naming its architecture) and the bf16 weights."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(
        {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}, path / "model.safetensors"
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket", default=None, help="where to publish (default: a temporary directory)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a tiny model

    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from ulstore.integrations.vllm.trainer import LLMClient, UlstoreTrainer, UlstoreTrainerInitInfo

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        llm = LLM(
            str(hf_dir(model, Path(tmp) / "start")),
            dtype=torch.bfloat16,
            enforce_eager=True,
            max_model_len=128,
            skip_tokenizer_init=True,
            weight_transfer_config=WeightTransferConfig(backend="ulstore"),
        )
        sync = UlstoreTrainer.trainer_init(
            UlstoreTrainerInitInfo(rank=0, url=args.bucket or str(Path(tmp) / "bucket")), client=LLMClient(llm)
        )
        prompt = {"prompt_token_ids": [1, 20, 21, 22, 23]}
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        data = torch.arange(20, 52).repeat(4, 1)  # a sequence to learn
        for step in range(args.steps + 1):
            if step:
                model(input_ids=data, labels=data).loss.backward()
                opt.step()
                opt.zero_grad()
            info = sync.send_weights(
                {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}, step, copy=False
            )
            info = info.result()  # committed and the engine moved: generate on this version
            out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
            print(
                f"step {step}: {info.delta_bytes / 1e3:.1f} kB, engine at version {llm.get_weight_version()}: {list(out)}"
            )
        sync.shutdown()
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM spawns its workers: the guard keeps them from running this script
    main()
