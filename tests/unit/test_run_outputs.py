"""What a run shows of itself: training.log_completions' samples, throughput, the end-of-run
table's named windows, training.keep_checkpoints, data.system_prompt, config.yaml."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gdpo_ray import completion_log
from gdpo_ray.batch import GroupData, build_groups
from gdpo_ray.groups import describe_groups


def test_samples_spread_over_groups_round_by_round():
    assert completion_log.pick([3, 3, 3], 2) == [(0, 0), (1, 0)]
    assert completion_log.pick([3, 3, 3], 5) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    assert completion_log.pick([1, 3], 4) == [(0, 0), (1, 0), (1, 1), (1, 2)]  # fewer rollouts than asked
    assert completion_log.pick([2, 2], 0) == [] and completion_log.pick([], 3) == []


def test_completion_samples_hold_the_text_every_reward_its_error_and_the_advantage(monkeypatch):
    groups = [GroupData(prompt_id=p, group_id=f"{p}/e0/a0", prompt_token_ids=[100 + i],
                        response_token_ids=[[i, j] for j in range(2)], response_logprobs=[[-1.0] * 2] * 2,
                        finish_reasons=["stop", "length"], policy_version=i,
                        rewards=np.array([[1.0, float(j)], [0.0, np.nan]], np.float32),
                        reward_errors=[["", ""], ["", "ValueError: no answer"]])
              for i, (p, j) in enumerate([("a", 0), ("b", 1)])]
    batch = build_groups(groups, ["format", "correct"])
    refs = describe_groups(batch, ref="object")
    monkeypatch.setattr(completion_log, "read_groups",
                        lambda chosen: [batch.slice(g.start, g.stop - g.start) for g in chosen])
    decode = lambda ids: " ".join(map(str, ids))
    advantages = np.array([0.5, -0.5, 1.0, -1.0])
    samples = completion_log.completion_samples(refs, advantages, ["format", "correct"], 3, decode)
    assert samples[0] == {"prompt_id": "a", "prompt": "100", "completion": "0 0", "rewards/format": 1.0,
                          "rewards/correct": 0.0, "advantage": 0.5, "finish_reason": "stop",
                          "policy_version": 0, "reward_errors": ""}
    assert [(s["prompt_id"], s["completion"], s["advantage"]) for s in samples] == \
        [("a", "0 0", 0.5), ("b", "1 0", 1.0), ("a", "0 1", -0.5)]
    assert samples[1]["rewards/correct"] == 1.0 and samples[1]["policy_version"] == 1
    assert math.isnan(samples[2]["rewards/correct"]) and samples[2]["finish_reason"] == "length"
    assert samples[2]["reward_errors"] == "correct: ValueError: no answer"
    assert completion_log.completion_samples(refs, advantages, ["format", "correct"], 0, decode) == []


def test_throughput_is_per_second_of_the_steps_wall_time():
    from gdpo_ray.metrics import throughput_metrics

    assert throughput_metrics(900.0, 30, 1.5) == {"throughput/tokens_per_s": 600.0, "throughput/samples_per_s": 20.0}
    assert all(math.isnan(v) for v in throughput_metrics(1.0, 1, 0.0).values())


def test_the_end_of_run_table_names_its_windows():
    from gdpo_ray.run.train import summary

    rows = [{"step": s, "rewards/a/mean": float(s)} for s in range(1, 11)]
    assert summary(rows, ["a"]).splitlines() == [
        "batch mean of each reward", "reward        steps 1-3 steps 8-10", "a                 2.000      9.000"]
    assert summary(rows[:3], ["a"]).splitlines()[1:] == ["reward        step 1  step 3", "a              1.000   3.000"]
    assert summary(rows[:1], ["a", "b"]).splitlines()[1:] == [
        "reward        step 1  step 1", "a              1.000   1.000", "b                nan     nan"]


def test_keep_checkpoints_deletes_the_oldest_step_checkpoints_only(tmp_path):
    from gdpo_ray.run.checkpoints import COMPLETE_MARKER, prune_checkpoints

    for name, version in [("step_000001", 1), ("step_000002", 2), ("step_000003", 3), ("final", 3)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / COMPLETE_MARKER).write_text(f"policy_version {version}\n")
    (tmp_path / "step_000009").mkdir()  # incomplete (no marker): not a checkpoint, never touched
    assert prune_checkpoints(tmp_path, None) == []
    assert prune_checkpoints(tmp_path, 2) == [str(tmp_path / "step_000001")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_000002", "step_000003", "step_000009"]
    assert prune_checkpoints(tmp_path, 1) == [str(tmp_path / "step_000002")]
    assert prune_checkpoints(tmp_path / "missing", 1) == []


class _Tokenizer:
    """Renders messages as role: content lines (what the template saw)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": text}


@pytest.mark.parametrize("prompt, seen", [
    ("2+2?", "system: Be brief.\nuser: 2+2?"),
    ([{"role": "user", "content": "hi"}], "system: Be brief.\nuser: hi"),
    ([{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}], "system: Own.\nuser: hi"),
])
def test_the_system_prompt_goes_before_every_prompt_without_its_own(prompt, seen):
    from actors.rollout import RolloutActor

    actor = RolloutActor.__new__(RolloutActor)  # its tokenize step alone
    actor.tokenizer, actor.chat_template, actor.tools, actor.system_prompt = _Tokenizer(), True, None, "Be brief."
    assert actor.tokenize(prompt) == seen
    actor.system_prompt = None
    assert actor.tokenize("2+2?") == "user: 2+2?"


def test_a_system_prompt_needs_the_chat_template():
    from gdpo_ray.run.presets import apply_sections, load_preset
    from gdpo_ray.run.algorithm import GDPOConfig

    config = apply_sections(GDPOConfig(), load_preset("demo", ["data.system_prompt=Be brief.",
                                                               "llm.chat_template=false"]))
    with pytest.raises(ValueError, match="data.system_prompt needs llm.chat_template=true"):
        config.validate()


def test_the_saved_config_is_a_preset_that_trains_the_same_config(tmp_path):
    import yaml

    from gdpo_ray.run.algorithm import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset, resolved_sections
    from gdpo_ray.run.train import run_settings

    sections = load_preset("agent", ["training.lr=3e-5", "debugging.seed=7", "run.loggers=[jsonl]"])
    config, run = apply_sections(GDPOConfig(), sections), run_settings(sections)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(resolved_sections(config, run), sort_keys=False))
    again = load_preset(str(tmp_path / "config.yaml"))
    assert again == resolved_sections(apply_sections(GDPOConfig(), again), run_settings(again))
    assert again["training"]["lr"] == 3e-5 and again["debugging"]["seed"] == 7
    assert again["data"]["tool_environment"] == config.tool_environment and again["run"]["loggers"] == ["jsonl"]


def test_the_policy_keeps_the_base_models_dtype(tmp_path):
    import json

    from gdpo_ray.model_files import saved_dtype

    for config, dtype in [({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                          ({}, "float32"), ({"dtype": "int8"}, "float32")]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert saved_dtype(tmp_path) == dtype
    assert saved_dtype(tmp_path / "missing") == "float32"


def test_rllibs_api_stack_notice_is_dropped_and_nothing_else(caplog):
    import logging

    from gdpo_ray.run import quiet
    from gdpo_ray.run.algorithm import GDPOConfig

    config = GDPOConfig()  # installs the filters
    assert config.log_sys_usage is False  # Tune's monitor thread off: it warns without gputil
    logger = logging.getLogger(quiet.FILTERS[0][0])
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("You are running GDPO on the new API stack! This is the new default ...")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    quiet.install()
    assert len(logger.filters) == len({f.start for f in logger.filters})  # installed once


def test_group_latency_is_from_each_groups_last_token_to_the_update():
    from gdpo_ray.metrics import latency_metrics

    # waits 1, 2, 3, 4 s (one group's time unknown): mean 2.5; the 95th percentile interpolates
    # between the 3rd and 4th sorted waits at 0.85 of the way: 3 + 0.85 = 3.85
    assert latency_metrics([99.0, 98.0, None, 97.0, 96.0], 100.0) == {
        "timing/group_latency_mean_s": 2.5, "timing/group_latency_p95_s": pytest.approx(3.85)}
    assert latency_metrics([None], 100.0) == {}
