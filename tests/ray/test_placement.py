"""Issue 29 item 10 (placement): a config whose actors the cluster can never hold is refused at
once, naming what it asks, what the cluster has and the fix, instead of waiting forever in the
learners' placement group."""

import pytest

from gdpo_ray import GDPOConfig
from gdpo_ray.run.presets import apply_sections, load_preset
from tests.hang import hang_guard


def test_actors_the_cluster_can_never_hold_are_refused_at_once(ray_cluster):
    total = ray_cluster.cluster_resources()["CPU"]  # the session cluster: 8 logical CPUs
    config = apply_sections(GDPOConfig(), load_preset("demo", [
        "env_runners.num_env_runners=2", f"env_runners.num_cpus_per_env_runner={total / 2:g}"]))
    with hang_guard(120, "build_algo of a run the cluster cannot hold"), pytest.raises(ValueError) as err:
        config.build_algo()  # two rollout actors take every CPU; the learner needs one more
        # (before this check, LearnerGroup.__init__ waited for its placement group forever)
    message = " ".join(str(err.value).split())
    assert f"this run's actors ask for CPU {total + 1:g} (the cluster has {total:g})" in message
    assert "no autoscaler" in message and "env_runners.num_cpus_per_env_runner" in message


def test_the_demand_adds_learners_and_rollout_actors():
    from gdpo_ray.run.placement import demand, shortfall

    config = GDPOConfig().env_runners(num_env_runners=[2, 4], num_cpus_per_env_runner=0.5,
                                      custom_resources_per_env_runner={"rollout": 1})
    config.learners(num_learners=2, num_cpus_per_learner=1, num_gpus_per_learner=1)
    # learners 2 x (1 CPU, 1 GPU) + rollout actors at the minimum, 2 x (0.5 CPU, 1 rollout)
    assert demand(config) == {"CPU": 3.0, "GPU": 2.0, "rollout": 2.0}
    assert shortfall(demand(config), {"CPU": 8.0, "GPU": 1.0}) == {"GPU": (2.0, 1.0), "rollout": (2.0, 0.0)}
