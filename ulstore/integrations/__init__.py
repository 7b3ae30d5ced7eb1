"""Bridges from ulstore to the frameworks around training and inference.

One sub-package per framework, each imported only when asked for (its framework
is an optional extra): :mod:`ulstore.integrations.vllm` is the ``ulstore``
weight-transfer backend of vLLM (the ``vllm`` extra).
"""
