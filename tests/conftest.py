"""Shared test setup: one thread per process, local Ray without token authentication, one Ray
cluster and one tiny model for the whole session, GPU tests skipped where there is no GPU."""

import os
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cuda"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run benchmarks/gpu_check.sh on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _ray_in_the_foreground(monkeypatch):
    """`gdpo-ray train` run in a test's process starts no Ray in the background: its Ray is the
    session's (``ray_cluster``), or none (tests of what fails first). A run as a user runs it
    (a subprocess of the command) starts its own as the command does."""
    from gdpo_ray.run import cluster

    monkeypatch.setattr(cluster, "begin", lambda run: None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random Qwen2 model and its locally trained tokenizer, saved as a HF directory."""
    from gdpo_ray.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that needs one."""
    import ray

    from gdpo_ray.run.cluster import LOCAL_RAY_CONFIG

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_CONFIG,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_weights(ray_cluster, tiny_model_dir):
    """The tiny model's own weights in the object store (what a learner would push)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return ray_cluster.put({k: v.detach().numpy() for k, v in model.state_dict().items()})


@pytest.fixture
def example_registrations(monkeypatch):
    """For tests of docs/examples' extensions, which register names in the driver's registries
    (estimators, eval suite families, weight transports) when imported: afterwards the
    registries are as they were and the example modules forgotten, so no other test sees them."""
    import sys

    from gdpo_ray.advantages import ESTIMATORS
    from gdpo_ray.eval.suites import SUITES
    from gdpo_ray.run.transports import TRANSPORTS

    for registry in (ESTIMATORS, SUITES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    transports = dict(TRANSPORTS)
    yield
    TRANSPORTS.clear()
    TRANSPORTS.update(transports)
    for name in [m for m in sys.modules if m.startswith("docs.examples")]:
        del sys.modules[name]
