"""Digests of weights and optimizer state, computed inside the actors by the tests themselves
(Ray's ``__ray_call__`` runs a function on the actor instance): the framework keeps none."""

import hashlib


def _sha_named(named) -> str:
    h = hashlib.sha256()
    for name, tensor in named:
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _sha_nested(h, value) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        h.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _sha_nested(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _sha_nested(h, v)
    else:
        h.update(repr(value).encode())


def _learner_weights(learner) -> str:
    return _sha_named(learner.sender.host_tensors(every_name=False))  # a ZeRO-3 collective


def _learner_optimizer(learner) -> str:
    h = hashlib.sha256()
    _sha_nested(h, learner.engine.optimizer.state_dict())
    return h.hexdigest()


def _engine_weights(actor) -> str:
    return _sha_named(actor.engine.model.named_parameters())  # the hf engine's model


def learner_digests(group) -> list[str]:
    """sha256 of every learner rank's parameters (float32; equal on all ranks)."""
    import ray

    return ray.get([learner.__ray_call__.remote(_learner_weights) for learner in group.learners])


def optimizer_digests(group) -> list[str]:
    """sha256 of every learner rank's optimizer state."""
    import ray

    return ray.get([learner.__ray_call__.remote(_learner_optimizer) for learner in group.learners])


def actor_digest(handle, version: int = 0) -> str:
    """sha256 of a rollout actor's (hf) engine parameters, comparable with ``learner_digests``."""
    import ray

    ray.get(handle.settled.remote(version), timeout=300)  # the pushes it was sent, loaded
    return ray.get(handle.__ray_call__.remote(_engine_weights))


def actor_digests(handles, version: int = 0) -> list[str]:
    import ray

    ray.get([h.settled.remote(version) for h in handles], timeout=300)  # the pushes they were sent, loaded
    return ray.get([h.__ray_call__.remote(_engine_weights) for h in handles])
