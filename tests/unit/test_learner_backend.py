"""``learners.backend`` (issue 49): the field, its checks before any actor starts, the note that
``training.zero_stage`` does not apply under fsdp2, a resume that keeps its backend, and the
contract every registered backend fulfils."""

import json
import pickle

import pytest

from gdpo_ray import GDPOConfig
from gdpo_ray.config import FIELDS, RESUME_FIXED, field_lines
from gdpo_ray.run.presets import apply_sections, load_preset
from learners.backend import BACKENDS, LearnerBackend, learner_class

REWARDS = [{"name": "correct", "fn": "math_correctness"}]


def good() -> GDPOConfig:
    return (GDPOConfig().llm(model_path="demo").data(prompts="task:addition")
            .training(rewards=REWARDS, group_size=4, prompts_per_step=2))


def test_the_field_its_default_and_where_it_is_set():
    assert FIELDS["backend"].section == "learners" and FIELDS["backend"].default == "deepspeed"
    assert "backend" in RESUME_FIXED
    assert any(line.startswith("learners.backend") for line in field_lines("learners"))
    assert good().backend == "deepspeed" and good().learner_config.backend == "deepspeed"
    config = good().learners(backend="fsdp2", num_learners=2)  # beside RLlib's own learner settings
    config.validate()
    assert (config.backend, config.num_learners, config.learner_config.backend) == ("fsdp2", 2, "fsdp2")
    overridden = apply_sections(GDPOConfig(), load_preset("demo", ["learners.backend=fsdp2"]))
    assert overridden.backend == "fsdp2" and overridden.num_learners == 1
    assert GDPOConfig().update_from_dict(config.to_dict()).backend == "fsdp2"  # Tune's round trip


@pytest.mark.parametrize("value, message", [
    ("megatron", "learners.backend must be one of deepspeed, fsdp2, simulated (or 'package.module:Class' of a "
                 "learners.learner.Learner); got 'megatron'; e.g. learners.backend=fsdp2"),
    ("FSDP2", "learners.backend must be one of deepspeed, fsdp2"),
    (2, "learners.backend must be a string; got 2 (int); e.g. learners.backend=deepspeed"),
    ("learners.nowhere:Learner", "learners.backend 'learners.nowhere:Learner': cannot import"),
    ("learners.learner:LearnerConfig", "is not a learner backend: subclass learners.learner.Learner"),
    ("learners.learner:Learner", "is not a learner backend: it leaves abstract: backward, checkpoint_weights, "
                                 "full_tensors, grad_norm, init_distributed, load, param_groups, save, "
                                 "shares_prompts, wrap"),
])
def test_an_unknown_backend_is_refused_before_any_actor_starts(value, message):
    with pytest.raises(ValueError) as err:
        good().learners(backend=value).validate()
    assert message in str(err.value)
    with pytest.raises(ValueError, match="learners.backend"):  # and in a preset's override
        apply_sections(GDPOConfig(), load_preset("demo", [f"learners.backend={value}"])).validate()


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_fulfils_the_contract(name):
    from learners.learner import Learner

    cls = learner_class(name)
    assert issubclass(cls, Learner) and issubclass(cls, LearnerBackend) and not cls.__abstractmethods__
    assert f"{cls.__module__}:{cls.__qualname__}" == BACKENDS[name]
    assert learner_class(BACKENDS[name]) is cls  # also by its import path


def test_zero_stage_is_said_not_to_apply_under_fsdp2_once(tmp_path, monkeypatch, capsys):
    from gdpo_ray.run.cli import main
    from gdpo_ray.run.preflight import learner_notes
    from gdpo_ray.run.train import TrainingRun

    assert learner_notes(good()) == []
    (note,) = learner_notes(good().learners(backend="fsdp2", num_learners=2).training(zero_stage=3))
    assert note.startswith("learners.backend=fsdp2: training.zero_stage (3) does not apply; FSDP2 shards "
                           "parameters, gradients and optimizer state over the 2 learner(s)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))
    (tmp_path / "config.yaml").write_text(json.dumps({
        "llm": {"model_path": "tiny", "max_prompt_tokens": 256}, "generation": {"max_tokens": 16},
        "data": {"prompts": "task:addition"},
        "training": {"group_size": 2, "prompts_per_step": 2, "rewards": REWARDS}, "learners": {"backend": "fsdp2"}}))
    assert main(["check", "config.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.count("gdpo-ray: note: learners.backend=fsdp2: training.zero_stage (2) does not apply") == 1
    assert main(["check", "config.yaml", "learners.backend=deepspeed"]) == 0
    assert "zero_stage" not in "".join(line for line in capsys.readouterr().out.splitlines()
                                       if line.startswith("gdpo-ray: note"))


def test_a_resume_keeps_its_backend(tmp_path):
    from gdpo_ray.run.checkpoints import COMPLETE_MARKER, resume_changes

    def checkpoint(state: dict) -> str:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "class_and_ctor_args.pkl").write_bytes(pickle.dumps(
            {"class": None, "ctor_args_and_kwargs": ((state,), {})}))  # as RLlib writes a checkpoint
        (folder / COMPLETE_MARKER).write_text("")
        return str(folder)

    fsdp2 = checkpoint(good().learners(backend="fsdp2").get_state())
    assert resume_changes(good().learners(backend="fsdp2"), fsdp2) == []
    with pytest.raises(ValueError, match="learners.backend was 'fsdp2' and is 'deepspeed' now; the learners' "
                                         "checkpoint is in its backend's format: set learners.backend=fsdp2"):
        resume_changes(good(), fsdp2)
    older = good().get_state()
    del older["backend"]  # a checkpoint written before the field: DeepSpeed's
    assert resume_changes(good(), checkpoint(older)) == []
    with pytest.raises(ValueError, match="learners.backend was 'deepspeed' and is 'fsdp2' now"):
        resume_changes(good().learners(backend="fsdp2"), checkpoint(older))
