"""Every worked example of docs/architecture.md (docs/examples/*.py) in one real training step
on the session's Ray cluster: the engine (by import path, in the rollout actor), the reward (by
import path, in the reward workers), the estimator, the weight transport and the eval suite
(registered by name in this, the driver's, process). The page shows these files, so it cannot
drift from what runs."""

from gdpo_ray import GDPOConfig
from gdpo_ray.run.presets import apply_sections, load_preset
from tests.digests import learner_digests


def _chunked_engine_weights(actor) -> str:
    from tests.digests import _sha_named

    return _sha_named(actor.engine.inner.model.named_parameters())


def test_one_step_with_every_extension_of_the_architecture_page(ray_cluster, example_registrations):
    import docs.examples.gathered_transport  # noqa: F401 - registers weight_sync "gathered"
    import docs.examples.no_batch_norm_estimator  # noqa: F401 - registers estimator "gdpo_no_batch_norm"
    import docs.examples.repeat_suite  # noqa: F401 - registers the eval suite family "repeat"

    config = apply_sections(GDPOConfig(), load_preset("demo", [
        "training.prompts_per_step=4", "training.group_size=4", "training.max_staleness=0",
        "generation.max_tokens=16", "generation.prompts_per_call=4"]))
    config.training(estimator="gdpo_no_batch_norm", weight_sync="gathered", eval_every=1,
                    eval_suite="repeat:2", eval_samples=2, eval_max_tokens=4,
                    rewards=[*config.rewards, {"name": "brief", "fn": "docs.examples.brevity_reward:brevity",
                                               "params": {"limit": 8}}])
    config.generation(engine="docs.examples.chunked_engine:ChunkedHFEngine", engine_kwargs={"max_prompts": 2})
    algo = config.build_algo()
    try:
        result = algo.train()
        actor = algo.rollouts.slots[0].handle
        version = ray_cluster.get(actor.policy_version.remote())
        actor_weights = ray_cluster.get(actor.__ray_call__.remote(_chunked_engine_weights))
        engine = ray_cluster.get(actor.__ray_call__.remote(lambda a: (type(a.engine).__name__, a.engine.max_prompts)))
        learner = learner_digests(algo.learners)[0]
    finally:
        algo.stop()
    assert engine == ("ChunkedHFEngine", 2)
    assert 0 <= result["rewards/brief/mean"] <= 1 and result["rewards/brief/failure_rate"] == 0
    assert type(algo.transport).__name__ == "GatheredTransport"
    assert version == 1 and actor_weights == learner  # the gathered push landed
    assert result["eval/repeat:2/pass@1"] >= 0  # the suite evaluated the policy on the actors
