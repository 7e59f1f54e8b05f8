"""Every learner backend through the contract (``learners.backend``): the registered ones and the
worked example of docs/architecture.md (``docs/examples/ddp_learner.py``, torch's DDP), each on
two learners: one update as DeepSpeed ZeRO-2 computes it, a checkpoint from which new learners
compute the next update exactly, a push that the rollout actors attest."""

import numpy as np
import pytest

from gdpo_ray.run.transports import ObjectStoreTransport, push_weights
from learners.backend import BACKENDS
from learners.learner_group import LearnerGroup
from tests.ray.test_learner import ADV, config, fixed_batch, two_rollout_actors  # noqa: F401 - a fixture

DDP = "docs.examples.ddp_learner:DDPLearner"
METRICS = ("loss", "pg_loss", "grad_norm", "entropy", "tokens")


@pytest.fixture(scope="module")
def zero2(ray_cluster, tiny_model_dir, fixed_batch):
    """DeepSpeed ZeRO-2's first update on two learners: (metrics, weights)."""
    group = LearnerGroup(config(tiny_model_dir, backend="deepspeed", zero_stage=2, epochs=1), num_learners=2)
    try:
        return group.update(fixed_batch, ADV), group.get_weights()
    finally:
        group.shutdown()


# every backend that trains a model (the simulated one trains none: tests/ray/test_simulation.py)
@pytest.mark.parametrize("backend", [*(b for b in BACKENDS if b != "simulated"), DDP])
def test_every_backend_updates_resumes_and_pushes_alike(ray_cluster, tiny_model_dir, fixed_batch, zero2, tmp_path,
                                                       backend):
    cfg = config(tiny_model_dir, backend=backend, zero_stage=2, epochs=1)
    rollouts = two_rollout_actors(tiny_model_dir)
    try:
        group = LearnerGroup(cfg, num_learners=2)
        try:
            first = (group.update(fixed_batch, ADV), group.get_weights())
            group.save_checkpoint(str(tmp_path))
            expected = (group.update(fixed_batch, ADV), group.get_weights())
            ray_cluster.get([s.starting for s in rollouts.slots])
            push_weights(ObjectStoreTransport(group, 64 << 10), rollouts, 1)
            rollouts.ledger.settle()  # every actor has loaded it and reported, the sender's digests in
            rollouts.collect()
        finally:
            group.shutdown()
        resumed_group = LearnerGroup(cfg, num_learners=2)
        try:
            assert resumed_group.load_checkpoint(str(tmp_path)) == 1
            resumed = (resumed_group.update(fixed_batch, ADV), resumed_group.get_weights())
        finally:
            resumed_group.shutdown()
    finally:
        rollouts.shutdown()
    for key in METRICS:  # the same first update as ZeRO-2's, to float rounding
        assert first[0][key] == pytest.approx(zero2[0][key], rel=1e-5), key
    for name, value in zero2[1].items():  # one AdamW step of lr 1e-3 (the ranks sum in their order)
        np.testing.assert_allclose(first[1][name], value, rtol=0, atol=2e-6, err_msg=name)
    for key in METRICS:  # the next update, exactly as the learners that saved the checkpoint computed it
        assert resumed[0][key] == expected[0][key], key
    for name, value in expected[1].items():
        np.testing.assert_array_equal(resumed[1][name], value, err_msg=name)
    assert rollouts.ledger.attested == 1
