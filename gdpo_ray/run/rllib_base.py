"""RLlib's base classes, imported without torch (``gdpo_ray.run.torchless``: the driver runs no
network, and RLlib's modules fall back to their stubs)."""

from __future__ import annotations

from gdpo_ray.run.torchless import torch_kept_out

with torch_kept_out():
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
    from ray.rllib.utils.checkpoints import Checkpointable

__all__ = ["Algorithm", "AlgorithmConfig", "Checkpointable", "NotProvided"]
