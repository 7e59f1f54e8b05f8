"""One local Ray cluster for every test in this folder."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_weights(ray_cluster, tiny_model_dir):
    """The tiny model's own weights in the object store (what a learner would push)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return ray_cluster.put({k: v.detach().numpy() for k, v in model.state_dict().items()})
