"""GDPO as an RLlib algorithm on a local Ray cluster: real rollout actors (hf engine), a real
DeepSpeed learner (gloo), the demo task and its warm-started tiny model."""

import numpy as np
import pytest

from gdpo_ray import GDPO, GDPOConfig
from gdpo_ray.run.presets import apply_sections, load_preset
from tests.digests import actor_digest, actor_digests, learner_digests, optimizer_digests


def demo_config(*overrides: str) -> GDPOConfig:
    # one generate call per step's prompts, as the tests were written for
    base = ["training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=32",
            "generation.prompts_per_call=4"]
    return apply_sections(GDPOConfig(), load_preset("demo", base + list(overrides)))


def assert_every_prompt_accounted_for(algo, trained: int) -> None:
    """Every prompt handed out is in exactly one state: trained, filtered or in flight."""
    p = algo.prompts
    outcomes = [s for e in range(p.epoch + 1) for s in p.outcomes(e).values()]
    assert outcomes.count("trained") == trained
    assert p.in_flight == len(algo.buffer) + algo.rollouts.in_flight


def learner_digest(algo) -> str:
    return learner_digests(algo.learners)[0]


def payload_spy(ray_module, monkeypatch) -> list:
    """Records every Arrow payload that ``ray.get`` hands to this (the driver) process."""
    import pyarrow as pa

    fetched, get = [], ray_module.get

    def spying_get(refs, *args, **kwargs):
        values = get(refs, *args, **kwargs)
        for v in values if isinstance(values, list) else [values]:
            if isinstance(v, (pa.RecordBatch, pa.Table)):
                fetched.append(v.nbytes)
        return values

    monkeypatch.setattr(ray_module, "get", spying_get)
    return fetched


def test_steps_metrics_staleness_overlap_and_prompt_accounting(ray_cluster, monkeypatch):
    from ray.rllib.callbacks.callbacks import RLlibCallback

    seen = []

    class Record(RLlibCallback):
        def on_train_result(self, *, algorithm, result, **kwargs):
            seen.append(result["step"])

    algo = demo_config("training.max_staleness=1").callbacks(Record).build_algo()
    try:
        start = learner_digest(algo)
        fetched = payload_spy(ray_cluster, monkeypatch)
        results = [algo.train() for _ in range(3)]
        assert fetched == []  # the driver read metadata only: no payload came to its process
        assert seen == [1.0, 2.0, 3.0]  # RLlib callbacks still run
        with pytest.raises(AttributeError, match="frozen"):  # as RLlib freezes its configs
            algo.config.lr = 1.0
        for r in results:
            for name in ("format", "correct", "length"):
                assert 0 <= r[f"rewards/{name}/mean"] <= 1 and f"adv/{name}/std" in r
                assert 0 <= r[f"rewards/{name}/zero_spread_groups"] <= 1
            shares = [r[f"adv/{name}/share"] for name in ("format", "correct", "length")]
            assert sum(shares) == pytest.approx(1.0, abs=1e-5) or shares == [0.0] * 3
            assert 0 <= r["rewards/length/gate_open"] <= 1  # length is paid only when correct
            for phase in ("take_groups", "advantages", "update", "push_weights", "metrics"):
                assert r[f"timing/{phase}_s"] >= 0
            assert r["staleness/max"] <= 1 and r["groups"] == 4
            assert r["distinct_advantage_groups"] >= 1 and r["response_length/max"] <= 32
        # the weights moved, and every rollout actor holds the learner's
        assert learner_digest(algo) != start
        actor = algo.rollouts.slots[0].handle
        assert ray_cluster.get(actor.policy_version.remote()) == 3
        assert actor_digest(actor, algo.rollouts.version) == learner_digest(algo)
        # overlap (max_staleness = 1): after the first step, every step trains groups that the
        # policy one version older sampled while the step before it was being learned (whether
        # they finish during that update or just after it is a race: groups_during_update)
        assert [r["staleness/max"] for r in results[1:]] == [1.0, 1.0]
        assert_every_prompt_accounted_for(algo, trained=12)
    finally:
        algo.stop()


def test_dynamic_sampling_filters_groups_where_no_reward_varies(ray_cluster):
    # one binary reward and groups of 2: many groups have no spread (at the first step, some
    # 3 in 4 of them: refills enough that every step fills its 4 groups whatever the order the
    # groups arrive in)
    config = demo_config("training.dynamic_sampling=true", "training.group_size=2",
                         "training.max_refills=40")
    algo = config.training(rewards=config.rewards[:1]).build_algo()  # the format reward
    try:
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    assert all(r["groups"] == 4 and r["zero_advantage_groups"] == 0 for r in results)
    filtered = sum(r["filtered_groups"] for r in results)
    p = algo.prompts
    outcomes = [s for e in range(p.epoch + 1) for s in p.outcomes(e).values()]
    assert filtered > 0 and outcomes.count("filtered: no training signal in the group (no weighted reward varies)") == filtered
    assert outcomes.count("trained") == 12


def test_a_reward_failing_on_every_rollout_stops_the_run_with_its_error(ray_cluster, caplog):
    from gdpo_ray.reward_watch import RewardFailure

    config = demo_config("training.max_staleness=0")
    config.training(rewards=config.rewards[:1] + [
        {"name": "judge", "fn": "tests.unit.pool_rewards:fails_on_model_output"}])
    algo = config.build_algo()
    try:
        first = algo.train()  # trains (format still has signal), loudly
        assert first["rewards/judge/errors"] == 16 and first["rewards/judge/failure_rate"] == 1
        assert first["rewards/judge/timeouts"] == first["rewards/judge/infra_failures"] == 0
        assert "reward 'judge' failed on 16 of 16 rollouts of step 1; first error: error: " \
               "ValueError: model output is not JSON" in caplog.text
        with pytest.raises(RewardFailure, match=r"reward 'judge' failed on 100% of the rollouts "
                                                r"for 2 steps in a row .* its error: error: "
                                                r"ValueError: model output is not JSON"):
            algo.train()
        assert algo.policy_version == 1  # the second step did not train on it
    finally:
        algo.stop()


def test_the_start_up_check_runs_before_any_actor(ray_cluster):
    config = demo_config()
    config.training(rewards=[{"name": "broken", "fn": "tests.unit.pool_rewards:raise_on_3"},
                             {"name": "needs", "fn": "tests.unit.trl_style_rewards:boxed_equals"}])
    config.data(prompts=[{"prompt": "1 + 2?", "answer": "3"}] * 4)
    with pytest.raises(ValueError, match="reward 'needs' needs column 'ground_truth'"):
        config.build_algo()  # raised by setup before it builds the learners and rollout actors


@pytest.mark.parametrize("sync, when", [("broadcast", "between steps"), ("broadcast", "during the push"),
                                        ("object_store", "during the push")])
def test_weight_sync_survives_a_dead_rollout_actor(ray_cluster, sync, when, monkeypatch):
    config = demo_config(f"training.weight_sync={sync}", "env_runners.num_env_runners=2",
                         "training.max_staleness=0")
    algo = config.build_algo()
    try:
        algo.train()
        victim = algo.rollouts.slots[0].handle
        if when == "between steps":
            ray_cluster.kill(victim)
        else:  # the actor dies as the push starts: its part of it never runs
            method = "receive_weights" if sync == "broadcast" else "set_weights"
            real = getattr(victim, method)

            class Dying:
                def remote(self, *args):
                    ray_cluster.kill(victim)
                    return real.remote(*args)

            monkeypatch.setattr(victim, method, Dying())
        results = [algo.train() for _ in range(2)]
        assert [r["step"] for r in results] == [2, 3]
        assert results[-1]["rollout/actor_restarts"] >= 1
        # every rollout actor (the replacement too) holds the learner's weights
        digests = actor_digests(algo.rollouts.receivers(), algo.rollouts.version)
        assert set(digests) == {learner_digest(algo)}
        assert_every_prompt_accounted_for(algo, trained=12)
    finally:
        algo.stop()


def test_every_prompt_too_long_stops_the_run_with_the_reason(ray_cluster):
    from actors.rollout import PromptsExhausted

    config = demo_config("llm.max_prompt_tokens=8")
    config.data(prompts=[{"prompt": "please add these numbers: " + "1 + 2 + 3 " * 20,
                          "ground_truth": "x"}] * 6)
    algo = config.build_algo()
    try:
        with pytest.raises(PromptsExhausted, match=r"no prompt could be generated for a whole "
                                                   r"epoch .* prompt too long \(\d+ > 8 tokens\)"):
            algo.train()
    finally:
        algo.stop()


def test_colocated_layout_shares_the_learners_bundles(ray_cluster):
    algo = demo_config("generation.colocate=true", "training.max_staleness=0").build_algo()
    try:
        results = [algo.train() for _ in range(2)]
        # one bundle per learner, holding the learner's CPU and its rollout actor's
        assert algo.learners.pg.bundle_specs == [{"CPU": 2.0}]
        assert algo.rollouts._placement_group is algo.learners.pg
        actor = algo.rollouts.slots[0].handle
        assert actor_digest(actor, algo.rollouts.version) == learner_digest(algo)
    finally:
        algo.stop()
    assert [r["step"] for r in results] == [1.0, 2.0] and results[-1]["staleness/max"] == 0


def test_learns_the_demo_task_synchronously(ray_cluster):
    """max_staleness = 0, fixed seeds: every reward's mean over the last steps beats the first;
    the learner takes the rollout actor's idle core (threads_alone) for every whole update."""
    algo = demo_config("training.prompts_per_step=16", "training.group_size=8", "training.threads_alone=2",
                       "generation.max_tokens=40", "training.max_staleness=0").build_algo()
    pumps, pump = [], algo.rollouts.pump
    algo.rollouts.pump = lambda *a, **k: pumps.append("until" in k) or pump(*a, **k)  # during updates
    try:
        rows = [algo.train() for _ in range(16)]
    finally:
        algo.stop()
    assert all(r["staleness/max"] == 0 for r in rows)
    assert [(r["learner/threads_end"], r["learner/thread_turns"]) for r in rows] == [(2, 0)] * len(rows)
    # nothing is in flight while the learner updates: the driver sleeps until it finishes (or
    # 0.05 s pass), it does not spin beside it (a spin took a fifth of a core from the learner)
    assert 0 < sum(pumps) <= sum(r["timing/update_s"] for r in rows) / 0.05 + 2 * len(rows), sum(pumps)
    for name in ("format", "correct", "length"):
        means = [r[f"rewards/{name}/mean"] for r in rows]
        assert np.mean(means[-4:]) > np.mean(means[:4]) + 0.05, (name, means)
    # the demo's rewards start at or below half their maximum
    assert all(rows[0][f"rewards/{n}/mean"] <= 0.5 for n in ("format", "correct", "length"))


def test_checkpoint_resume_is_exact(ray_cluster, tmp_path):
    algo = demo_config("training.max_staleness=1").build_algo()
    try:
        algo.train()
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        saved = {"digest": learner_digest(algo), "opt": optimizer_digests(algo.learners)[0],
                 "prompts": algo.prompts.state_dict(algo.buffer.group_ids()),
                 "buffered": algo.buffer.group_ids()}
        algo.train()  # the original run goes on; the restored one starts from step 2
    finally:
        algo.stop()
    restored = GDPO.from_checkpoint(path)
    try:
        assert restored.policy_version == 2 and restored.iteration == 2
        assert learner_digest(restored) == saved["digest"]
        assert optimizer_digests(restored.learners)[0] == saved["opt"]
        assert restored.buffer.group_ids() == saved["buffered"]
        assert restored.prompts.state_dict(saved["buffered"]) == saved["prompts"]
        actor = restored.rollouts.slots[0].handle
        assert actor_digest(actor, restored.rollouts.version) == saved["digest"]
        result = restored.train()
        assert result["step"] == 3
        p = restored.prompts
        trained = [s for e in range(p.epoch + 1) for s in p.outcomes(e).values() if s == "trained"]
        assert len(trained) == 12  # 8 before the checkpoint + 4 now: none lost, none twice
    finally:
        restored.stop()


def test_a_killed_learner_is_recovered_from_the_last_checkpoint(ray_cluster, tmp_path):
    """The step in which a learner died is redone on new learners from the last checkpoint, with
    the steps between it and that checkpoint, in the same ``train()``: it returns the metrics of
    the step after the previous call's (finite, as every step's, never NaN), so no step number is
    returned (or logged) twice and the iteration counts train() calls (issue 50)."""
    algo = demo_config("training.checkpoint_every=2",
                       f"training.checkpoint_dir={tmp_path}").build_algo()
    try:
        algo.train()
        algo.train()  # step_000002
        digest, restored = learner_digest(algo), []
        assert algo.train()["step"] == 3  # no checkpoint of step 3
        recover = algo._recover

        def recover_and_look(err):
            recover(err)
            restored.append((algo.policy_version, learner_digest(algo)))

        algo._recover = recover_and_look
        ray_cluster.kill(algo.learners.learners[0])
        result = algo.train()  # step 4's update fails: new learners, step 2 restored, steps 3 and 4 redone
        assert restored == [(2, digest)] and algo.last_recovery == (4, 2)
        assert algo.counters["learner_recoveries"] == 1 and algo.policy_version == 4
        assert result["step"] == 4 and result["learner_recoveries"] == 1 and algo.iteration == 4
        assert all(np.isfinite(result[f"rewards/{name}/mean"]) for name in algo.reward_names)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004"]
    finally:
        algo.stop()


def test_a_recovery_to_an_older_step_reloads_the_rollout_actors(ray_cluster):
    """A learner recovery without a checkpoint goes back to the start: the rollout actors, which
    hold a later version, load the start's weights all the same (a push is placed by its order
    in the sender's sequence, not by its version), and say they hold version 0."""
    algo = demo_config().build_algo()
    try:
        start = learner_digest(algo)
        algo.train()
        algo.train()
        [actor] = algo.rollouts.receivers()
        assert actor_digest(actor, 2) != start
        recover, after = algo._recover, []

        def recover_and_look(err):
            recover(err)
            algo.rollouts.ledger.settle()  # the restored weights' reports are in
            after.append((ray_cluster.get(actor.policy_version.remote()), actor_digest(actor)))

        algo._recover = recover_and_look
        ray_cluster.kill(algo.learners.learners[0])
        assert algo.train()["step"] == 3  # step 3's update fails: the start restored, steps 1-3 redone
        assert after == [(0, start)]
    finally:
        algo.stop()


def test_a_restore_keeps_its_timeline_under_keep_checkpoints(ray_cluster, tmp_path, caplog):
    """``algo.restore_from_path`` of a step older than the run's newest checkpoint (issue 50): the
    newer ones, of the timeline the restore leaves, are moved aside (named, said once) before a new
    one is written, so ``training.keep_checkpoints`` keeps the new timeline's checkpoints (an
    abandoned newer one would outrank them: each deleted as soon as written) and the one a learner
    recovery goes back to exists."""
    import logging

    from gdpo_ray.run.checkpoints import latest_checkpoint, verify_checkpoint

    root = tmp_path / "checkpoints"
    algo = demo_config("training.checkpoint_every=1", "training.keep_checkpoints=1",
                       f"training.checkpoint_dir={root}").build_algo()
    try:
        start = algo.save_to_path(str(tmp_path / "start"))  # step 0, outside the run's folder
        algo.train()
        algo.train()
        assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
        with caplog.at_level(logging.WARNING, logger="gdpo_ray.run.algorithm_state"):
            algo.restore_from_path(start)
        said = [r.getMessage() for r in caplog.records if "timeline" in r.getMessage()]
        [aside] = [p for p in root.iterdir() if p.name.startswith("abandoned-after-step_000000-")]
        assert said == [f"restored step 0 ({start}): the run's checkpoints of later steps, step_000002, are "
                        f"of the timeline this restore leaves: moved to {aside}, so that its own "
                        f"checkpoints (training.keep_checkpoints, a later resume) are not mixed with them"]
        assert verify_checkpoint(str(aside / "step_000002")) == []  # kept whole
        assert algo.train()["step"] == 1
        assert latest_checkpoint(root) == algo._last_checkpoint == str(root / "step_000001")
        assert sorted(p.name for p in root.iterdir()) == [aside.name, "step_000001"]
        assert len([r for r in caplog.records if "timeline" in r.getMessage()]) == 1  # said once
    finally:
        algo.stop()


def test_a_learner_dying_in_the_checkpoint_loses_nothing(ray_cluster, tmp_path, monkeypatch):
    """The automatic checkpoint is inside recovery, and only a complete one counts; event
    counters (a rollout actor's restart) survive the recovery."""
    from gdpo_ray.run.checkpoints import COMPLETE_MARKER, check_checkpoint

    algo = demo_config("training.checkpoint_every=1", f"training.checkpoint_dir={tmp_path}").build_algo()
    try:
        algo.train()  # step_000001, complete
        ray_cluster.kill(algo.rollouts.slots[0].handle)
        algo.train()
        restarts = algo.rollouts.stats["actor_restarts"]
        assert restarts >= 1
        learners = algo.learners
        real = learners.save_checkpoint

        def die_while_saving(path):  # the driver's state is written, then a learner dies
            ray_cluster.kill(learners.learners[0])
            monkeypatch.setattr(learners, "save_checkpoint", real)  # once
            return real(path)

        monkeypatch.setattr(learners, "save_checkpoint", die_while_saving)
        # update ok, then the checkpoint of step 3 fails: recovered from step 2, step 3 redone
        result = algo.train()
        assert algo.counters["learner_recoveries"] == 1 and algo.policy_version == 3
        assert algo.rollouts.stats["actor_restarts"] >= restarts  # not rolled back
        partial = [p for p in tmp_path.iterdir() if ".partial-" in p.name]
        assert partial and not (partial[0] / COMPLETE_MARKER).exists()
        with pytest.raises(ValueError, match="an incomplete checkpoint"):
            check_checkpoint(str(partial[0]))
        assert result["step"] == 3 and (tmp_path / "step_000003" / COMPLETE_MARKER).exists()
        assert result["rollout/actor_restarts"] >= restarts
    finally:
        algo.stop()


@pytest.mark.slow
def test_tune_runs_and_restores(ray_cluster, tmp_path):
    from ray import tune

    config = demo_config()
    tuner = tune.Tuner(GDPO, param_space=config, run_config=tune.RunConfig(
        storage_path=str(tmp_path), name="gdpo", stop={"training_iteration": 1},
        checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True), verbose=0))
    result = tuner.fit().get_best_result(metric="rewards/format/mean", mode="max")
    assert result.error is None and result.metrics["step"] == 1
    # the trial's checkpoint is a GDPO checkpoint
    algo = GDPO.from_checkpoint(result.checkpoint.path)
    try:
        assert algo.policy_version == 1 and algo.train()["step"] == 2
    finally:
        algo.stop()
    restored = tune.Tuner.restore(str(tmp_path / "gdpo"), trainable=GDPO)
    # the restored experiment is complete (stop reached): fit returns the same trial result
    again = restored.fit().get_best_result(metric="rewards/format/mean", mode="max")
    assert again.metrics["step"] == 1 and again.error is None


def test_a_run_with_a_tool_environment_trains_on_multi_turn_records(ray_cluster):
    """data.tool_environment through the whole run: every rollout gets its own Calculator, reset with
    its row; the environment's column beside a function's; the records carry the turn columns,
    the learners train on them, and the turn metrics are logged. (The demo model writes no tool
    calls: each rollout is one turn. tests/unit/test_tool_loop.py runs rollouts that call tools.)"""
    config = demo_config("data.tool_environment=tests.unit.trl_style_environments:Calculator",
                         "generation.max_turns=3",  # the demo's template ignores tools=; its prompts stay short
                         "data.tools_in_system_prompt=never")
    rewards = [config.rewards[0], {"name": "memory_used", "fn": "environment"},
               {"name": "state", "fn": "environment", "weight": 0}]  # every column Calculator gives is declared
    algo = config.training(rewards=rewards).build_algo()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    for r in results:
        assert r["rollout/turns/mean"] == 1.0 and r["rollout/tool_calls/mean"] == 0.0
        assert r["rollout/tool_errors"] == 0.0 and r["rollout/tool_timeouts"] == 0.0
        assert r["rewards/memory_used/mean"] == 0.0 and r["rewards/memory_used/failure_rate"] == 0.0
        assert np.isfinite(r["learner/loss"])


def test_a_run_in_trls_dict_form_scores_each_row_with_its_own_class(ray_cluster):
    """data.tool_environment={name: Class} with a per-row environment column: each rollout is
    scored by its own class's columns; the other class's columns do not apply to it (counted as
    not applicable, not as failures), and the run trains."""
    from gdpo_ray.tasks import task_rows

    rows = [{**r, "environment": ("calc", "count")[i % 2]} for i, r in enumerate(task_rows("task:addition", 32))]
    envs = {"calc": "tests.unit.trl_style_environments:Calculator", "count": "tests.unit.trl_style_environments:Counter"}
    config = demo_config("generation.max_turns=3", "data.tools_in_system_prompt=never").data(
        prompts=rows, tool_environment=envs)
    rewards = [config.rewards[0], {"name": "memory_used", "fn": "environment"}, {"name": "Counter", "fn": "environment"},
               {"name": "state", "fn": "environment", "weight": 0}]
    algo = config.training(rewards=rewards).build_algo()
    try:
        r = algo.train()
    finally:
        algo.stop()
    assert r["rewards/memory_used/failure_rate"] == 0.0 and r["rewards/Counter/failure_rate"] == 0.0
    assert r["rewards/memory_used/errors"] == 0.0 and r["rewards/Counter/errors"] == 0.0
    assert r["rewards/memory_used/not_applicable"] + r["rewards/Counter/not_applicable"] == 16  # 4 groups of 4
    assert r["rewards/memory_used/mean"] == 0.0 and r["rewards/Counter/mean"] == 0.0
    assert np.isfinite(r["learner/loss"])
