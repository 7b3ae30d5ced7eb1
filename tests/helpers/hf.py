"""Tiny real transformers models for the Hugging Face tests (CPU, nothing downloaded)."""

from __future__ import annotations


def tiny_bert_config(vocab_size: int = 512, hidden_size: int = 64):
    """A two-layer BERT config; feed-forward twice ``hidden_size`` wide, ``hidden_size`` positions."""
    import transformers

    return transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=hidden_size,
    )
