"""Whether the cluster can ever hold a run's actors, asked before the first one is started.

Ray waits for resources without a word: a run asking for more CPUs or GPUs than its cluster has
(two rollout actors and a learner on a 2-CPU local Ray) would wait forever for its learners'
placement group. ``check_placement`` adds up what the run's actors ask for (the rollout actors at
their minimum count, the learners' bundles, the rollout actors inside them when colocated) and
compares it with the cluster's total resources: short of them, with no autoscaler to add nodes,
the run is refused at once, naming what it asks, what the cluster has and the fix. With an
autoscaler, a warning is returned and the learners' placement waits at most
``learners.learner_group.PLACEMENT_TIMEOUT_S``.
"""

from __future__ import annotations

from typing import Any

from gdpo_ray import config as fields
from gdpo_ray.run import judges


def demand(config: Any) -> dict[str, float]:
    """Every Ray resource the run's actors ask for together (rollout actors at their minimum)."""
    rollout = {"CPU": config.num_cpus_per_env_runner, "GPU": config.num_gpus_per_env_runner,
               **config.custom_resources_per_env_runner}
    learner = {"CPU": config.num_cpus_per_learner, "GPU": config.num_gpus_per_learner}
    low = fields.env_runner_range(config)[0]
    bundles = [learner] * max(1, config.num_learners) + [rollout] * low + judges.demand(config)
    return fields.merge_resources(*bundles)


def shortfall(asked: dict[str, float], total: dict[str, float]) -> dict[str, tuple[float, float]]:
    """resource -> (asked, the cluster's total) for every resource the cluster has too little of."""
    return {k: (v, total.get(k, 0.0)) for k, v in asked.items() if v > total.get(k, 0.0) + 1e-9}


def check_placement(config: Any) -> str | None:
    """Raises ValueError when the cluster cannot hold the run's actors and cannot grow; returns a
    warning when it is short but an autoscaler may add nodes; None when it fits."""
    import ray

    short = shortfall(demand(config), ray.cluster_resources())
    if not short:
        return None
    lines = ", ".join(f"{k} {asked:g} (the cluster has {has:g})" for k, (asked, has) in sorted(short.items()))
    what = (f"this run's actors ask for {lines}: {max(1, config.num_learners)} learner(s) x "
            f"{config.num_cpus_per_learner:g} CPU / {config.num_gpus_per_learner:g} GPU and "
            f"{fields.env_runner_range(config)[0]} rollout actor(s) x {config.num_cpus_per_env_runner:g} "
            f"CPU / {config.num_gpus_per_env_runner:g} GPU"
            + (f" / {dict(config.custom_resources_per_env_runner)}" if config.custom_resources_per_env_runner else "")
            + (f" and {config.num_judges} judge actor(s) x {config.num_cpus_per_judge:g} CPU / "
               f"{config.num_gpus_per_judge:g} GPU" if judges.demand(config) else ""))
    if _autoscaling():
        return f"{what}; waiting for the autoscaler to add nodes"
    raise ValueError(f"{what}, more than the cluster will ever have (no autoscaler). Ask for less "
                     f"(env_runners.num_env_runners, env_runners.num_cpus_per_env_runner, "
                     f"learners.num_learners, learners.num_cpus_per_learner, judges.num_judges, "
                     f"judges.num_cpus_per_judge; CPUs may be fractions, "
                     f"e.g. 0.5), or give the local Ray more logical CPUs (run.num_cpus, or "
                     f"ray.init(num_cpus=N) from Python), or add nodes")


def _autoscaling() -> bool:
    """True when the cluster has an autoscaler (its config is in the GCS: KubeRay, the cluster
    launcher)."""
    try:
        from ray._private.state import state

        return state.get_cluster_config() is not None
    except Exception:  # noqa: BLE001 - no way to ask: assume a fixed cluster
        return False
