"""A simulated run (generation.engine and learners.backend simulated, docs/scale.md): the real
driver, rollout actors, rewards, Arrow records, buffer, pushes and attestation, with the model's
arithmetic replaced by a timing model; on a local Ray cluster."""

import pytest

from gdpo_ray import GDPOConfig
from gdpo_ray.run.presets import apply_sections, load_preset


def simulated_config(*overrides: str) -> GDPOConfig:
    base = ["llm.model_path=tiny", "generation.engine=simulated", "learners.backend=simulated",
            "training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=48",
            "training.max_staleness=1", "env_runners.num_env_runners=2",
            "simulation.time_scale=0.05", "simulation.weight_bytes=4096", "simulation.weight_tensors=4",
            "simulation.response_lengths={dist: uniform, low: 8, high: 64}"]
    return apply_sections(GDPOConfig(), load_preset("demo", base + list(overrides)))


@pytest.mark.parametrize("mode", ["streaming", "batched"])
def test_a_simulated_run_trains_pushes_and_attests(ray_cluster, mode):
    algo = simulated_config(f"generation.mode={mode}").build_algo()
    try:
        results = [algo.train() for _ in range(3)]
        algo.rollouts.ledger.settle()
        attested = algo.rollouts.ledger.attested
        versions = ray_cluster.get([s.handle.policy_version.remote() for s in algo.rollouts.slots])
    finally:
        algo.stop()
    for step, result in enumerate(results, 1):
        assert result["step"] == step and result["weights/push_bytes"] == 4096
        assert result["learner/tokens"] > 16 * 8  # 16 rollouts of at least 8 new tokens, prompts too
        # the learner slept the modelled update of its tokens (5,762 tokens/s, scaled)
        assert result["learner/modelled_s"] == pytest.approx(result["learner/tokens"] / 5762.0)
        assert all(result[f"rewards/{name}/failure_rate"] == 0 for name in ("format", "correct", "length"))
        assert result["staleness/max"] <= 1
    assert attested == 3 and versions == [3, 3]  # every push loaded by both actors and attested


def test_a_simulated_learner_needs_simulated_engines():
    with pytest.raises(ValueError, match="use generation.engine='simulated' too"):
        simulated_config("generation.engine=hf").validate()
    with pytest.raises(ValueError, match="is not a profile"):
        simulated_config("simulation.timing=gpt5").validate()
    with pytest.raises(ValueError, match="has no field 'median'"):
        simulated_config("simulation.response_lengths={median: 3}").validate()


def test_actors_on_a_node_reported_dead_are_replaced(ray_cluster, monkeypatch):
    """An actor whose node the cluster reports dead is replaced at the next step's check, with
    no call of its own failing first (an idle actor of a lost raylet has none)."""
    algo = simulated_config("env_runners.num_env_runners=2").build_algo()
    try:
        algo.train()
        group = algo.rollouts
        lost = group.slots[0].handle
        nodes = ray_cluster.nodes()
        monkeypatch.setattr(ray_cluster, "nodes", lambda: [dict(n, Alive=False) for n in nodes])
        group.replace_lost()
        monkeypatch.undo()
        assert group.stats["actor_restarts"] == 2 and lost not in group.receivers()
        assert [s.node_id for s in group.slots] == [None, None]  # placed anew once started
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    assert [r["step"] for r in results] == [2, 3] and results[-1]["rollout/actors"] == 2
    assert all(r["groups"] == 4 for r in results)
