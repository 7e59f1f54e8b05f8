"""generation.engine_in_learner: learner rank 0 hosts the rollout actor, whose hf engine shares
the learner's module (``gdpo_ray.run.in_learner``): a real DeepSpeed learner (gloo), the demo
task and its warm-started tiny model, on a local Ray cluster."""

import numpy as np

from gdpo_ray import GDPOConfig
from gdpo_ray.run.presets import apply_sections, load_preset
from tests.digests import learner_digests


def hosted_config(*overrides: str) -> GDPOConfig:
    base = ["training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=32",
            "generation.prompts_per_call=4", "training.max_staleness=0", "generation.engine_in_learner=true"]
    return apply_sections(GDPOConfig(), load_preset("demo", base + list(overrides)))


def _shares_the_module(learner) -> bool:
    return learner._rollouts.engine.model is learner.module


def _module_mode(learner) -> bool:
    return learner.module.training


def assert_hosted_step(result: dict) -> None:
    """Every group sampled by the weights the step trains (nothing stale, nothing pushed), and
    the learner's logprobs of the sampled tokens are the engine's up to float rounding."""
    assert result["staleness/max"] == 0 and result["rollout/dropped_stale"] == 0
    assert result["weights/push_bytes"] == 0
    assert abs(result["learner/is/ratio_min"] - 1) < 1e-4 and abs(result["learner/is/ratio_max"] - 1) < 1e-4


def test_the_learner_hosts_the_engine_on_its_own_module(ray_cluster):
    algo = hosted_config().build_algo()
    try:
        learner = algo.learners.learners[0]
        assert algo.rollouts.receivers() == [learner]  # no rollout actor process of its own
        assert ray_cluster.get(learner.__ray_call__.remote(_shares_the_module))
        digests = [learner_digests(algo.learners)[0]]
        for step in (1, 2, 3):
            result = algo.train()
            assert result["step"] == step
            assert_hosted_step(result)
            digests.append(learner_digests(algo.learners)[0])
        assert len(set(digests)) == 4  # every update changed the weights the next step sampled from
        algo.rollouts.ledger.settle()
        assert algo.rollouts.ledger.attested == 3  # each version's report arrived
        # evaluation runs on the hosted engine too, and leaves the module in the learner's mode
        mode = ray_cluster.get(learner.__ray_call__.remote(_module_mode))
        [completions] = algo.rollouts.complete(["What is 2 + 3?"], 2, {"max_tokens": 8, "temperature": 1.0})
        assert len(completions) == 2 and all(c.tokens for c in completions)
        assert ray_cluster.get(learner.__ray_call__.remote(_module_mode)) == mode
        p = algo.prompts
        trained = [s for e in range(p.epoch + 1) for s in p.outcomes(e).values()].count("trained")
        assert trained == 12 and p.in_flight == len(algo.buffer) + algo.rollouts.in_flight
        # without a checkpoint a recovery goes back to step 0: the new learner's engine says
        # version 0 (not the version pushed last), so the redone steps' groups are on-policy
        ray_cluster.kill(learner)
        result = algo.train()  # steps 1-4 redone from the start
        assert result["step"] == 4 and result["learner_recoveries"] == 1
        assert_hosted_step(result)
        assert ray_cluster.get(algo.learners.learners[0].policy_version.remote()) == 4
    finally:
        algo.stop()


def test_a_killed_learner_hosts_the_engine_again(ray_cluster, tmp_path):
    """The rollout actor dies with its learner: the recovery's new learner hosts it again, and
    the run goes on from the last checkpoint, sampling from the restored weights."""
    algo = hosted_config("training.checkpoint_every=1", f"training.checkpoint_dir={tmp_path}").build_algo()
    try:
        algo.train()
        old = algo.learners.learners[0]
        ray_cluster.kill(old)
        result = algo.train()
        new = algo.learners.learners[0]
        assert new != old and algo.rollouts.receivers() == [new]
        assert ray_cluster.get(new.__ray_call__.remote(_shares_the_module))
        assert result["step"] == 2 and result["learner_recoveries"] == 1
        assert_hosted_step(result)
        assert all(np.isfinite(result[f"rewards/{name}/mean"]) for name in algo.reward_names)
        assert_hosted_step(algo.train())
    finally:
        algo.stop()


def _peft_wrapped(learner) -> bool:
    from peft import PeftModel

    return isinstance(learner._rollouts.engine.model, PeftModel) and learner._rollouts.engine.model is learner.module


def test_lora_generates_through_the_learners_adapter(ray_cluster):
    """Under llm.lora the engine is the learner's PEFT model: it samples through the adapter the
    update trains (the ratio stays 1 as the adapter moves)."""
    algo = hosted_config("llm.lora={r: 8, lora_alpha: 16, target_modules: all-linear}", "training.lr=1e-3").build_algo()
    try:
        assert ray_cluster.get(algo.learners.learners[0].__ray_call__.remote(_peft_wrapped))
        for _ in range(2):
            assert_hosted_step(algo.train())
    finally:
        algo.stop()
