"""vLLM follows a ulstore bucket: the ``ulstore`` weight-transfer backend (the ``vllm`` extra).

Read me first
-------------
- The ``vllm.general_plugins`` entry point calls :func:`register` in every vLLM
  process, so ``LLM(model, weight_transfer_config=WeightTransferConfig(backend="ulstore"))``
  or ``vllm serve ... --weight-transfer-config '{"backend": "ulstore"}'`` needs no other set-up.
- Each worker runs an :class:`~ulstore.integrations.vllm.engine.UlstoreEngine`:
  ``init_info = {"url": ..., "branch": ...}`` connects it to the bucket;
  ``update_info = {"version": v, "document": ...}`` moves it to version ``v`` in
  place, writing only the changed elements into vLLM's own (fused, TP-sliced)
  parameters, bit-exact, all or nothing.
- Where checkpoint tensors land is learned once per engine by watching the
  model's own ``load_weights`` (:mod:`._mapping`): no table per model.
- The trainer side is :class:`~ulstore.integrations.vllm.trainer.UlstoreTrainer`:
  ``send_weights(version, state)`` publishes the version and drives the
  engines through any ``VLLMWeightSyncClient`` (:class:`LLMClient` for an
  in-process ``LLM``), resetting their prefix cache.

See ``docs/vllm.md``.
"""

from __future__ import annotations

__all__ = ["register", "BACKEND", "UpdateRefusedError"]

#: the name the backend is registered under
BACKEND = "ulstore"

from ._refused import UpdateRefusedError  # noqa: E402  (no vLLM import: usable to catch without the extra)


def register() -> None:
    """Register the ``ulstore`` weight-transfer backend with vLLM (idempotent; the engine module loads lazily).

    vLLM calls this through the ``vllm.general_plugins`` entry point in every
    process it starts; call it yourself only where plugins are not loaded.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in (
        (WeightTransferEngineFactory, "ulstore.integrations.vllm.engine", "UlstoreEngine"),
        (WeightTransferTrainerFactory, "ulstore.integrations.vllm.trainer", "UlstoreTrainer"),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:  # registered already: a second call in this process
            pass
