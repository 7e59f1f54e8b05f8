"""GDPOConfig validation and YAML presets: every bad setting fails before any actor starts,
with a message that names the field and the fix."""

import pytest

from gdpo_ray import GDPOConfig
from gdpo_ray.config import FIELDS
from gdpo_ray.run.presets import apply_sections, load_preset, preset_names

REWARDS = [{"name": "correct", "fn": "math_correctness"}]
ENV = "tests.unit.trl_style_environments:"


def good() -> GDPOConfig:
    return (GDPOConfig().llm(model_path="demo").data(prompts="task:addition")
            .training(rewards=REWARDS, group_size=4, prompts_per_step=2))


def test_defaults_and_sections():
    config = good().training(lr=1e-4, clip_eps_high=0.3).generation(max_tokens=64)
    config.validate()
    assert (config.lr, config.clip_eps_high, config.max_tokens) == (1e-4, 0.3, 64)
    assert config.estimator == "gdpo" and config.max_staleness == 0 and config.eps == 1e-6
    # GDPO's sections, and RLlib's learners section for learners.backend (GDPOConfig.learners())
    assert all(f.doc and f.section in ("training", "llm", "generation", "data", "judges", "simulation", "learners")
               for f in FIELDS.values())
    # list defaults are not shared between configs
    other = GDPOConfig()
    assert other.rewards == [] and other.rewards is not GDPOConfig().rewards


@pytest.mark.parametrize("change, message", [
    (lambda c: c.training(estimator="ppo"), "estimator 'ppo' is not one of"),
    (lambda c: c.training(group_size=1), "group_size must be an integer >= 2"),
    (lambda c: c.training(prompts_per_step=0), "prompts_per_step must be an integer >= 1"),
    (lambda c: c.training(max_staleness=-1), "max_staleness must be an integer >= 0"),
    (lambda c: c.training(rewards=[]), "no rewards: use .training(rewards="),
    (lambda c: c.training(rewards=[{"name": "x", "fn": "nope"}]), "unknown reward 'nope'"),
    (lambda c: c.training(rewards=[{"name": "x", "fn": "length", "params": {"limit": -3}}]), "positive number of tokens"),
    (lambda c: c.training(rewards=REWARDS + [{"name": "l", "fn": "length", "condition": {"on": "zz", "min": 1}}]), "zz"),
    (lambda c: c.training(mini_batches=3), "mini_batches (3) must be <= prompts_per_step (2)"),
    (lambda c: c.training(weight_sync="nccl-ish"), "weight_sync must be"),
    (lambda c: c.training(clip_eps_low=-0.1), "clip_eps_low"),
    (lambda c: c.training(eps=-1.0), "eps must be a number >= 0"),
    (lambda c: c.llm(model_path=None), "no policy model: use .llm(model_path="),
    (lambda c: c.data(prompts=None), "no prompts: use .data(prompts="),
    (lambda c: c.data(columns={"ground_truth": 3}), "columns must map column names to nested fields"),
    (lambda c: c.generation(engine="tgi"), "unknown engine 'tgi'; known: hf, vllm"),
    (lambda c: c.generation(engine="vllm", top_p=0.9, truncated_logprobs=False), "set truncated_logprobs=true (the exact ratio), or top_p=1.0, top_k=0, min_p=0 with engine='vllm'"),
    (lambda c: c.generation(min_p=1.5), "generation.min_p must be a number >= 0 and <= 1"),
    (lambda c: c.generation(temperature=0.0), "temperature"),
    (lambda c: c.env_runners(num_env_runners=0), "num_env_runners must be an integer >= 1 or a range"),
    (lambda c: c.env_runners(num_env_runners=[3, 2]), "1 <= min <= max; got [3, 2]"),
    (lambda c: c.env_runners(num_env_runners=[1, 4]), "custom_resources_per_env_runner={'rollout': 1}"),
    (lambda c: c.generation(mode="continuous"), "generation.mode must be 'streaming' or 'batched'"),
    (lambda c: c.training(eval_every=5), "needs a suite: set training.eval_suite"),
    (lambda c: c.training(eval_suite="mmlu"), "unknown suite 'mmlu'"),
    (lambda c: c.training(eval_every=-1), "eval_every"),
    (lambda c: c.generation(mode="streaming"), "engine 'hf' takes batch calls: use generation.mode='batched'"),
    (lambda c: c.generation(engine="vllm", colocate=True), "use generation.mode='batched' with colocate=True"),
    (lambda c: c.generation(colocate=True).training(max_staleness=1), "use max_staleness=0"),
    (lambda c: c.generation(colocate=True).env_runners(num_env_runners=2), "num_env_runners == num_learners"),
    # the engine in the learner's process: synchronous, hf, one learner hosting one rollout actor
    (lambda c: c.generation(engine_in_learner=True).training(max_staleness=1), "use training.max_staleness=0"),
    (lambda c: c.generation(engine_in_learner=True, engine="vllm"), "use generation.engine=hf"),
    (lambda c: c.generation(engine_in_learner=True).learners(num_learners=2), "use learners.num_learners=1"),
    (lambda c: c.generation(engine_in_learner=True).env_runners(num_env_runners=2), "env_runners.num_env_runners=1"),
    (lambda c: c.generation(engine_in_learner=True).training(zero_stage=3), "training.zero_stage <= 2"),
    (lambda c: c.generation(engine_in_learner=True).learners(backend="fsdp2"), "use learners.backend=deepspeed"),
    (lambda c: c.generation(engine_in_learner=True, colocate=True), "set one of them"),
    (lambda c: c.generation(engine_in_learner=True).training(weight_sync="broadcast"), "nothing is sent"),
    (lambda c: c.generation(engine_in_learner=True, engine_kwargs={"dtype": "bfloat16"}), "leave generation.engine_kwargs unset"),
    (lambda c: c.generation(engine_in_learner=True).env_runners(num_gpus_per_env_runner=1), "num_gpus_per_env_runner"),
    # tool environments (data.tool_environment) and their reward columns
    (lambda c: c.training(rewards=REWARDS + [{"name": "state", "fn": "environment"}]),
     "rewards ['state'] are an environment's (fn: environment), and no environment is set"),
    (lambda c: c.data(tool_environment="tests.unit.trl_style_environments:NoTools"), "has no tool"),
    (lambda c: c.training(rewards=REWARDS + [{"name": "m", "fn": "tests.unit.test_tool_loop:memory_left"}]),
     "rewards ['m'] take TRL's `environments`"),
    (lambda c: c.data(tool_environment="Calculator"), "data.tool_environment must be 'module:Class'"),
    (lambda c: c.data(tool_environment=ENV + "Counter").training(rewards=REWARDS + [{"name": "n", "fn": "environment"}]),
     "declare its one column as TRL names it, {name: Counter, fn: environment}"),
    (lambda c: c.data(tool_environment=ENV + "NoReset"), "has no reset method"),
    (lambda c: c.data(tool_environment=ENV + "Calculator").training(
        rewards=REWARDS + [{"name": "state", "fn": "environment", "params": {"x": 1}}]), "it takes no params"),
    (lambda c: c.generation(max_turns=0), "max_turns must be an integer >= 1"),
    (lambda c: c.data(tool_environment=ENV + "Calculator").llm(chat_template=False), "needs llm.chat_template=true"),
    (lambda c: c.generation(tool_timeout=0), "tool_timeout must be a number > 0"),
    # GSPO: the default clip range (0.2 / 0.28) barely acts on a sequence ratio within ~1e-3 of 1
    (lambda c: c.training(ratio_level="sequence", loss_agg="seq_mean_token_mean"),
     "use .training(clip_eps_low=3e-4, clip_eps_high=4e-4)"),
    (lambda c: c.training(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4),
     "loss_agg='token_mean' would be ignored there; use .training(loss_agg='seq_mean_token_mean')"),
])
def test_validation_names_the_fix(change, message):
    config = change(good())
    with pytest.raises(ValueError) as err:
        config.validate()
    assert message in str(err.value)


def test_generation_mode_defaults_to_streaming_on_vllm_only():
    from actors.engines import generation_mode

    assert good().rollout_actor_kwargs["mode"] == "batched"
    assert good().generation(engine="vllm").rollout_actor_kwargs["mode"] == "streaming"
    assert generation_mode("tests.engines:ScriptedEngine", None) == "batched"  # a class of one's own
    batched = good().generation(engine="vllm", mode="batched").training(weight_sync="broadcast")
    batched.validate()
    assert batched.rollout_actor_kwargs["mode"] == "batched"
    # a streaming actor takes every weight channel in flight (gloo on CPU, vLLM's NCCL on CUDA)
    streaming = good().generation(engine="vllm").training(weight_sync="broadcast")
    streaming.validate()
    assert streaming.rollout_actor_kwargs["mode"] == "streaming"


def test_an_environment_and_its_columns_validate():
    good().data(tool_environment=ENV + "Calculator").training(
        rewards=REWARDS + [{"name": "state", "fn": "environment"}]).validate()
    good().data(tool_environment=ENV + "Counter").training(rewards=REWARDS + [{"name": "Counter", "fn": "environment"}]).validate()
    good().data(tool_environment=ENV + "Calculator").validate()  # an environment's tools without its rewards


def test_gspo_with_its_own_clip_range_and_aggregation_validates():
    good().training(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4,
                    loss_agg="seq_mean_token_mean").validate()


def test_unknown_setting_of_a_section():
    with pytest.raises(TypeError, match="'modle_path' is not a setting of .llm()"):
        GDPOConfig().llm(modle_path="x")
    with pytest.raises(TypeError):
        GDPOConfig().training(not_a_field=1)


def test_presets_load_merge_and_build_a_valid_config():
    assert {"demo", "smollm2_math"} <= set(preset_names())
    sections = load_preset("demo", ["training.lr=1e-3", "run.steps=5"])
    assert sections["training"]["lr"] == 1e-3 and sections["run"]["steps"] == 5
    config = apply_sections(GDPOConfig(), sections)
    config.validate()
    assert [r["name"] for r in config.rewards] == ["format", "correct", "length"]
    # an unquoted `on:` in YAML is the boolean True (YAML 1.1): the condition still works
    unquoted = {"name": "l", "fn": "length", "condition": {True: "correct", "min": 1.0}}
    assert GDPOConfig().training(rewards=[unquoted]).rewards[0]["condition"] == {"on": "correct", "min": 1.0}
    assert config.rewards[2]["condition"] == {"on": "correct", "min": 1.0}
    assert apply_sections(GDPOConfig(), load_preset("smollm2_math")).model_path == "smollm2"
    for name in ("tool_calling", "math", "code", "bfcl_multi_turn"):  # the GPU-scale presets, as shipped
        apply_sections(GDPOConfig(), load_preset(name)).validate()
    # the tool-calling study in miniature: the paper preset's rewards on the warm-started tiny model
    study = apply_sections(GDPOConfig(), load_preset("study_tool_calling"))
    study.validate()
    assert (study.model_path, study.prompts, study.eval_suite) == ("demo-tools", "task:tool_calls", "task:tool_calls")
    assert study.rewards == apply_sections(GDPOConfig(), load_preset("tool_calling")).rewards
    # the agent preset: a multi-turn tool environment; data.environment (TRL's word) is another
    # name for data.tool_environment, not RLlib's environment builder
    agent = apply_sections(GDPOConfig(), load_preset("agent"))
    agent.validate()
    assert agent.tool_environment == "gdpo_ray.environments.arithmetic:Arithmetic"
    alias = apply_sections(GDPOConfig(), {"data": {"environment": "tests.unit.trl_style_environments:Calculator"}})
    assert alias.tool_environment == "tests.unit.trl_style_environments:Calculator" and alias.env is None
    # an override by the other name replaces the preset's value; a YAML with both names is refused
    replaced = apply_sections(GDPOConfig(), load_preset("agent", ["data.environment=tests.unit.trl_style_environments:Calculator"]))
    assert replaced.tool_environment == "tests.unit.trl_style_environments:Calculator"
    with pytest.raises(ValueError, match="sets 'tool_environment' twice"):
        apply_sections(GDPOConfig(), {"data": {"environment": "a:B", "tool_environment": "c:D"}})
    # an override replaces the preset's value, a mapping too (it is not merged into it)
    gpu = load_preset("math", ["generation.engine_kwargs={}", "data.columns={ground_truth: a.b}",
                               "training.rewards.1.params.limit=12"])
    assert gpu["generation"]["engine_kwargs"] == {} and gpu["data"]["columns"] == {"ground_truth": "a.b"}
    assert gpu["training"]["rewards"][1] == {"name": "length", "fn": "length", "params": {"limit": 12}}


def test_preset_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'; presets: "):
        load_preset("nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_preset(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="bad override 'training.lr': expected section.key=value"):
        load_preset("demo", ["training.lr"])
    with pytest.raises(ValueError, match="unknown config section 'trainig'"):
        apply_sections(GDPOConfig(), {"trainig": {"lr": 1.0}})
    with pytest.raises(ValueError, match="section 'env_runners'"):
        apply_sections(GDPOConfig(), {"env_runners": {"num_rollout_actors": 2}})


def test_train_command_rejects_a_bad_config_before_any_actor_and_stops_its_ray(capsys, monkeypatch, tmp_path):
    """`gdpo-ray train` starts its local Ray in the background once the run section is read; a
    config or a start-up check that fails afterwards stops it (and no actor starts). The order of
    the calls, recorded here; the real Ray's start and stop: tests/e2e/test_local_ray.py."""
    from gdpo_ray.run import cluster
    from gdpo_ray.run.cli import main
    from gdpo_ray.run.train import TrainingRun

    class Starting:  # the Ray a run starts in the background, recorded
        def __init__(self) -> None:
            self.waited = self.stopped = False

        def wait(self) -> None:
            self.waited = True

        def stop(self) -> None:
            self.stopped = True

    begun: list = []
    monkeypatch.setattr(cluster, "begin", lambda run: begun.append(Starting()) or begun[-1])
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was used"))
    monkeypatch.chdir(tmp_path)

    assert main(["train", "training.group_size=1"]) == 2  # RLlib's config: checked while Ray starts
    assert "group_size must be an integer >= 2" in capsys.readouterr().err
    assert main(["train", "demo", "data.prompts=missing.jsonl"]) == 2  # the start-up check
    assert "missing.jsonl" in capsys.readouterr().err
    assert [(s.waited, s.stopped) for s in begun] == [(False, True), (False, True)]
    assert main(["train", "demo", "run.stepz=3"]) == 2  # the run section: read before Ray starts
    assert "'stepz' is not a setting of section 'run'; did you mean 'steps'?" in capsys.readouterr().err
    assert len(begun) == 2
    assert not (tmp_path / "runs").exists()


def test_resume_changes_name_what_differs_and_refuse_other_data(tmp_path):
    import pickle

    from gdpo_ray.run.checkpoints import COMPLETE_MARKER, resume_changes

    saved = good().training(lr=2e-4)
    with open(tmp_path / "class_and_ctor_args.pkl", "wb") as f:  # as RLlib writes a checkpoint
        pickle.dump({"class": None, "ctor_args_and_kwargs": ((saved.get_state(),), {})}, f)
    # a save cut short has no completion marker: refused, naming the complete ones beside it
    with pytest.raises(ValueError, match="an incomplete checkpoint .* no gdpo_checkpoint_complete"):
        resume_changes(good().training(lr=2e-4), str(tmp_path))
    (tmp_path / COMPLETE_MARKER).write_text("")
    assert resume_changes(good().training(lr=2e-4), str(tmp_path)) == []
    assert resume_changes(good().training(lr=1e-5, max_staleness=1), str(tmp_path)) == [
        ("max_staleness", 0, 1), ("lr", 2e-4, 1e-5)]
    with pytest.raises(ValueError, match="data.prompts was 'task:addition' and is 'task:arithmetic'"):
        resume_changes(good().training(lr=2e-4).data(prompts="task:arithmetic"), str(tmp_path))
    with pytest.raises(ValueError, match="debugging.seed was None and is 1"):
        resume_changes(good().training(lr=2e-4).debugging(seed=1), str(tmp_path))
    with pytest.raises(ValueError, match="not a gdpo-ray checkpoint"):
        resume_changes(good(), str(tmp_path / "nothing"))


def test_defaults_and_rules_have_one_source():
    import inspect

    from actors.engines import SamplingParams
    from actors.rollout import RolloutActor
    from gdpo_ray.config import RLLIB_FIELDS, default
    from gdpo_ray.losses import PolicyLossConfig
    from gdpo_ray.off_policy import OffPolicy
    from learners.deepspeed_learner import LearnerConfig

    sampling, loss, learner = SamplingParams(), PolicyLossConfig(), LearnerConfig(model_path="m")
    for name in ("temperature", "top_p", "top_k", "max_tokens"):
        assert getattr(sampling, name) == FIELDS[name].default, name
    for name in ("clip_eps_low", "clip_eps_high", "dual_clip", "loss_agg", "ratio_level",
                 "kl_coef", "kl_estimator"):
        assert getattr(loss, name) == FIELDS[name].default, name
    assert loss.off_policy == OffPolicy.parse(FIELDS["off_policy"].default)
    for name in ("zero_stage", "precision", "weight_decay", "micro_batch_tokens", "mini_batches",
                 "temperature", "num_threads", "lr", "grad_clip"):
        assert getattr(learner, name) == default(name), name
    assert learner.epochs == RLLIB_FIELDS["num_epochs"].default
    actor = inspect.signature(RolloutActor).parameters
    for name in ("engine", "chat_template", "max_prompt_tokens", "reward_workers", "num_threads"):
        assert actor[name].default == FIELDS[name].default, name
    config = GDPOConfig()
    for name, f in RLLIB_FIELDS.items():  # GDPO's defaults of RLlib's fields
        assert getattr(config, name) == f.default, name
    # the same bound rule wherever the setting is given
    with pytest.raises(ValueError, match=r"generation.top_p must be a number > 0 and <= 1; got 1.5"):
        good().generation(top_p=1.5).validate()
    with pytest.raises(ValueError, match=r"sampling top_p must be a number > 0 and <= 1; got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"training.zero_stage must be an integer >= 0 and <= 3; got 4"):
        good().training(zero_stage=4).validate()
    with pytest.raises(ValueError, match=r"LearnerConfig.zero_stage must be an integer >= 0 and <= 3; got 4"):
        LearnerConfig(model_path="m", zero_stage=4)
    with pytest.raises(ValueError, match=r"training.reward_failure_limit must be a number > 0; got 0"):
        good().training(reward_failure_limit=0).validate()


def test_validate_runs_rllib_validation_after_ours(monkeypatch):
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    calls = []
    monkeypatch.setattr(AlgorithmConfig, "validate", lambda self: calls.append("rllib"))
    good().validate()
    assert calls == ["rllib"]
    with pytest.raises(ValueError, match="group_size"):  # ours first: RLlib's never ran
        good().training(group_size=1).validate()
    assert calls == ["rllib"]


def test_no_setting_shadows_a_method_of_rllibs_config():
    """A GDPOConfig attribute named like an AlgorithmConfig method hides it: ``environment`` did
    (Tune's restore calls ``config.environment(env_config=...)``), hence ``tool_environment``."""
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

    assert [n for n in FIELDS if callable(getattr(AlgorithmConfig, n, None))] == []
    config = good().data(tool_environment=ENV + "Calculator")
    assert GDPOConfig().update_from_dict(config.to_dict()).tool_environment == ENV + "Calculator"


@pytest.mark.parametrize("section, key, message", [
    ("training", "seed", "'seed' is not a setting of section 'training'; it is `debugging.seed`"),
    ("training", "temperature", "'temperature' is not a setting of section 'training'; it is `generation.temperature`"),
    ("training", "learning_rate", "'learning_rate' is not a setting of section 'training'; TRL's learning_rate is `training.lr` here"),
    ("training", "num_generations", "TRL's num_generations is `training.group_size` here"),
    ("generation", "max_completion_length", "TRL's max_completion_length is `generation.max_tokens` here (with a tool"),
    ("data", "environment_factory", "TRL's environment_factory is `data.environment` here"),
    ("training", "steps", "'steps' is not a setting of section 'training'; it is `run.steps`"),
    ("training", "group_sise", "did you mean 'group_size'?"),
])
def test_a_setting_in_the_wrong_place_or_by_trls_name_is_answered_with_its_home(section, key, message):
    with pytest.raises(ValueError) as err:
        apply_sections(GDPOConfig(), {section: {key: 1}})
    assert message in str(err.value) and "(its settings:" not in str(err.value)


def test_every_trl_name_points_at_a_setting_and_is_on_the_migration_page():
    from pathlib import Path

    from gdpo_ray.config import RUN_SETTINGS, TRL_NAMES, setting_home
    from gdpo_ray.run.train import RUN_DEFAULTS

    assert set(RUN_SETTINGS) == set(RUN_DEFAULTS)  # the run section's names, where the leaf can see them

    page = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    for trl, (ours, _) in TRL_NAMES.items():
        section, name = ours.split(".")
        assert setting_home(name) == ours or ours == "data.environment", trl
        assert f"| `{trl}` | `{ours}` |" in page, trl


def test_list_fields_prints_every_setting_with_its_default_and_doc(capsys):
    from gdpo_ray.run.cli import main

    assert main(["list", "fields", "generation"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["generation.engine", '"hf"'] and all(l.startswith("generation.") for l in lines)
    assert main(["list", "fields"]) == 0
    out = capsys.readouterr().out
    assert "debugging.seed" in out and "run.steps" in out and "data.tool_environment" in out
    with pytest.raises(SystemExit, match="no section 'nope'"):
        main(["list", "fields", "nope"])
