"""RLlib's base classes, imported without torch (``gdpo_ray.kept_out``): GDPO's driver runs no
network (the policy lives in the learner and rollout actors, which import torch in their own
processes), and RLlib's modules, which import it as each loads for RLlib's own networks and
learners, fall back to their stubs. The driver's USS after RLlib's import: 383 -> 203 MiB."""

from __future__ import annotations

from gdpo_ray.kept_out import kept_out

with kept_out("torch"):
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
    from ray.rllib.utils.checkpoints import Checkpointable

__all__ = ["Algorithm", "AlgorithmConfig", "Checkpointable", "NotProvided"]
