"""A vLLM worker extension (``worker_extension_cls``): methods vLLM mixes into its GPU/CPU
worker, called by name through ``collective_rpc``.

The async engine's worker runs in a child process of the engine core, itself a child of the
rollout actor, so tensors cannot be handed over in memory: ``collective_rpc`` re-pickles its
arguments in the engine core, and tensors that arrived zero-copy cannot be pickled there
("cannot pickle memoryview objects"). A push is therefore one safetensors file (in
``/dev/shm``: memory, not disk) that the worker maps and loads through vLLM's own layer-wise
``reload_weights``. This module imports nothing of gdpo-ray: the engine processes only need it
on ``sys.path``.
"""

from __future__ import annotations


import logging

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryIsComputed(logging.Filter):
    """vLLM's layer-wise reload warns at every push that RotaryEmbedding "failed to load"
    weights: its cos/sin cache is computed, no checkpoint holds it, and vLLM puts it back."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")


def quiet_rotary_reload_warning() -> None:
    """Installs the filter above once in this process (the process of vLLM's worker)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryIsComputed) for f in logger.filters):
        logger.addFilter(_RotaryIsComputed())


class WeightsFromFile:
    """Mixed into vLLM's worker: ``self`` is the worker (``reload_weights`` is its method)."""

    def reload_from_file(self, path: str) -> int:
        """Loads every tensor of the safetensors file ``path``; returns how many."""
        from safetensors.torch import load_file

        quiet_rotary_reload_warning()
        weights = load_file(path)
        self.reload_weights(weights_iterator=list(weights.items()))
        return len(weights)
