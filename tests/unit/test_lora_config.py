"""Issue 30, part 1: the setting ``llm.lora`` and its checks. A bad value (its keys, its numbers,
a module the model does not have) is refused by `gdpo-ray train` / `check` before Ray starts,
naming ``llm.lora.<key>`` and the fix; a LoRA checkpoint resumes only with the same adapter; and
the names an adapter's weights are saved under are PEFT's own."""

import pytest

from gdpo_ray import lora
from gdpo_ray.lora import (adapter_key, check_target_modules, linear_module_names, lora_settings,
                           module_key, peft_config)
from gdpo_ray.model_files import resolve_model_path
from gdpo_ray.run.cli import main
from tests.unit import test_run_dirs
from tests.unit.test_run_dirs import COMMON, fake_checkpoint, no_ray  # noqa: F401 - a fixture

#: the linear layers of the demo model (a Qwen2): attention and MLP, the output head left out
DEMO_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_full_fine_tuning_is_none_and_a_setting_gets_pefts_defaults():
    assert lora_settings(None) is None and lora_settings({}) is None
    assert lora_settings({"r": 8}) == {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0,
                                       "target_modules": "all-linear"}
    assert lora_settings({"r": 4, "lora_alpha": 16.0, "lora_dropout": 0.05,
                          "target_modules": ("q_proj", "v_proj", "q_proj")}) == {
        "r": 4, "lora_alpha": 16.0, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


BAD = [
    ({"r": 0}, "llm.lora.r must be an integer >= 1 (the rank of the adapters); got 0; e.g. llm.lora.r=8"),
    ({"r": 2.5}, "llm.lora.r must be an integer >= 1"),
    ({"r": True}, "llm.lora.r must be an integer >= 1"),
    ({"lora_alpha": 16}, "llm.lora.r is required"),
    ({"r": 8, "lora_alpha": 0}, "llm.lora.lora_alpha must be a finite number > 0"),
    ({"r": 8, "lora_alpha": float("inf")}, "llm.lora.lora_alpha must be a finite number > 0"),
    ({"r": 8, "lora_dropout": 1.0}, "llm.lora.lora_dropout must be a number in [0, 1)"),
    ({"r": 8, "lora_dropout": float("nan")}, "llm.lora.lora_dropout must be a number in [0, 1)"),
    ({"r": 8, "target_modules": []}, "llm.lora.target_modules must be a non-empty list of module names"),
    ({"r": 8, "target_modules": ["q_proj", 3]}, "llm.lora.target_modules must be a non-empty list"),
    ({"r": 8, "target_modules": "q_proj"},  # PEFT would take a string as a regular expression
     "llm.lora.target_modules must be a list of module names or 'all-linear'; got 'q_proj'; "
     "e.g. llm.lora.target_modules=[q_proj, v_proj]"),
    ({"r": 8, "rank": 8},
     "'rank' is not a setting of llm.lora (its settings: lora_alpha, lora_dropout, r, target_modules;"),
    ({"r": 8, "alpha": 8}, "'alpha' is not a setting of llm.lora; did you mean 'lora_alpha'?"),
    (8, "llm.lora must be a mapping"),
]


@pytest.mark.parametrize("value, message", BAD, ids=[str(v) for v, _ in BAD])
def test_a_bad_setting_names_the_key_and_the_fix(value, message):
    with pytest.raises(ValueError) as err:
        lora_settings(value)
    assert message in str(err.value)


def test_the_peft_config_is_a_causal_lm_without_bias():
    from peft import LoraConfig, TaskType

    config = peft_config(lora_settings({"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    assert isinstance(config, LoraConfig) and config.task_type == TaskType.CAUSAL_LM
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (4, 16, 0.0, "none")
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert peft_config(lora_settings({"r": 8})).target_modules == "all-linear"


def test_the_linear_modules_are_found_without_weights_and_the_head_is_left_out(monkeypatch):
    demo = resolve_model_path("demo")
    assert linear_module_names(demo) == DEMO_LINEAR
    assert linear_module_names(str(demo)) == DEMO_LINEAR  # one cache entry per path, str or Path
    check_target_modules(lora_settings({"r": 8, "target_modules": ["q_proj", "self_attn.v_proj",
                                                                   "model.layers.0.mlp.up_proj"]}), demo)
    for bad in ("qproj", "lm_head", "proj", "embed_tokens"):  # the head and embeddings are not linear targets
        with pytest.raises(ValueError) as err:
            check_target_modules(lora_settings({"r": 8, "target_modules": ["q_proj", bad]}), demo)
        assert str(err.value) == (f"llm.lora.target_modules: the model has no linear module named "
                                  f"{bad!r}; its linear modules: {', '.join(DEMO_LINEAR)} (or use "
                                  f"llm.lora.target_modules=all-linear)")


def test_adapter_keys_are_those_peft_saves_and_loads(tiny_model_dir):
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, peft_config(lora_settings({"r": 2})))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    saved = get_peft_model_state_dict(model)
    assert len(names) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 layers
    assert sorted(adapter_key(n) for n in names) == sorted(saved)
    assert {module_key(k) for k in saved} == set(names)
    assert adapter_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert module_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    # a second adapter's names: PEFT's own mapping for another adapter name
    model.add_adapter("other", peft_config(lora_settings({"r": 2, "target_modules": ["q_proj"]})))
    other = [n for n, _ in model.named_parameters() if ".other." in n]
    assert sorted(adapter_key(n, "other") for n in other) == \
        sorted(get_peft_model_state_dict(model, adapter_name="other"))
    assert all(module_key(adapter_key(n, "other"), "other") == n for n in other)


def test_a_bad_rank_is_refused_by_train_before_ray(no_ray, capsys):
    assert main(["train", "demo", "llm.lora={r: 0}"]) == 2
    err = capsys.readouterr().err
    assert "gdpo-ray train: llm.lora.r must be an integer >= 1 (the rank of the adapters); got 0; " \
           "e.g. llm.lora.r=8 (or llm.lora=null for full fine-tuning)" in err, err


def test_a_module_the_model_lacks_is_refused_by_train_before_ray(no_ray, capsys):
    assert main(["train", "demo", "llm.lora={r: 8, target_modules: [qproj]}"]) == 2
    err = capsys.readouterr().err
    assert ("gdpo-ray train: llm.lora.target_modules: the model has no linear module named 'qproj'; "
            f"its linear modules: {', '.join(DEMO_LINEAR)}") in err, err


def test_check_passes_a_good_setting_and_shows_it(no_ray, capsys):
    assert main(["check", "demo", "llm.lora={r: 8, lora_alpha: 16, target_modules: all-linear}"]) == 0
    out = capsys.readouterr().out
    # the setting as the run uses it: normalized once, when the config is validated (defaults filled in)
    assert "lora: {r: 8, lora_alpha: 16, lora_dropout: 0.0, target_modules: all-linear}" in out, out
    assert "gdpo-ray check: demo is ready to train" in out


def lora_checkpoint(monkeypatch, run_dir, lora_override):
    """test_run_dirs' fake checkpoint of the demo preset, written with ``lora_override``."""
    with monkeypatch.context() as m:
        m.setattr(test_run_dirs, "COMMON", [*COMMON, lora_override])
        return fake_checkpoint(run_dir, 3)


RESUMES = [  # the checkpoint's llm.lora, this run's, and what the refusal says
    ("llm.lora={r: 8, lora_alpha: 16}", [],
     "llm.lora: the checkpoint was trained with {r: 8, lora_alpha: 16, lora_dropout: 0.0, "
     "target_modules: all-linear}, this run asks for none (full fine-tuning); a run resumes the "
     "weights it saved, which are those of the checkpoint's adapter: set llm.lora back to {r: 8, "
     "lora_alpha: 16, lora_dropout: 0.0, target_modules: all-linear}, or start a new run"),
    ("llm.lora={r: 8}", ["llm.lora={r: 16, target_modules: [q_proj, v_proj]}"],
     "this run asks for {r: 16, lora_alpha: 8, lora_dropout: 0.0, target_modules: [q_proj, v_proj]} "
     "(r 8 -> 16, target_modules all-linear -> [q_proj, v_proj])"),
    ("llm.lora={r: 8}", ["llm.lora={r: 8, lora_alpha: 32}"], "(lora_alpha 8 -> 32)"),
    ("llm.lora=null", ["llm.lora={r: 8}"],
     "llm.lora: the checkpoint was trained with none (full fine-tuning), this run asks for {r: 8, "
     "lora_alpha: 8, lora_dropout: 0.0, target_modules: all-linear}; a run resumes the weights it "
     "saved, which are those of the checkpoint's adapter: set llm.lora back to null, or start a new run"),
]


@pytest.mark.parametrize("saved, now, message", RESUMES,
                         ids=["lora->none", "r and targets", "alpha", "none->lora"])
def test_a_lora_checkpoint_resumes_only_with_its_adapter(no_ray, tmp_path, capsys, monkeypatch,
                                                         saved, now, message):
    checkpoint = lora_checkpoint(monkeypatch, tmp_path / "runs" / "old", saved)
    assert main(["train", "demo", *COMMON, *now, "--resume", str(checkpoint), "run.name=new"]) == 2
    err = capsys.readouterr().err
    assert f"gdpo-ray train: --resume {checkpoint}: llm.lora: " in err and message in err, err
    assert "Traceback" not in err and not (tmp_path / "runs" / "new").exists()


def test_the_same_adapter_written_otherwise_resumes(no_ray, tmp_path, monkeypatch):
    from gdpo_ray.run import checkpoints
    from gdpo_ray.run.train import TrainingRun

    checkpoint = lora_checkpoint(monkeypatch, tmp_path / "runs" / "old", "llm.lora={r: 8}")
    same = "llm.lora={r: 8, lora_alpha: 8, lora_dropout: 0.0, target_modules: all-linear}"
    resumed = TrainingRun.from_args("demo", [*COMMON, same, "run.name=new"], resume=str(checkpoint))
    assert [name for name, *_ in resumed.changes] == ["checkpoint_dir"]  # a new run's own folder
    # a checkpoint written before llm.lora existed has no such key: full fine-tuning, as before
    older = fake_checkpoint(tmp_path / "runs" / "older", 2)
    saved_config = checkpoints.saved_config
    monkeypatch.setattr(checkpoints, "saved_config",
                        lambda path: {k: v for k, v in saved_config(path).items() if k != "lora"})
    assert "lora" not in checkpoints.saved_config(str(older))
    resumed = TrainingRun.from_args("demo", [*COMMON, "run.name=new2"], resume=str(older))
    assert [name for name, *_ in resumed.changes] == ["checkpoint_dir"]
    with pytest.raises(ValueError, match="llm.lora: the checkpoint was trained with none"):
        TrainingRun.from_args("demo", [*COMMON, "llm.lora={r: 8}", "run.name=new3"], resume=str(older))


def test_a_model_transformers_cannot_build_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with pytest.raises(ValueError) as err:
        check_target_modules(lora_settings({"r": 8, "target_modules": ["q_proj"]}), tmp_path)
    assert str(err.value).startswith(f"llm.lora.target_modules: cannot build the model {tmp_path} "
                                     f"from its config to find its linear modules (")
    assert "llm.model_path must be a causal LM that transformers' AutoModelForCausalLM builds" in \
        str(err.value)


def test_the_setting_is_fixed_on_resume_in_the_field_table():
    from gdpo_ray.config import FIELDS, RESUME_FIXED

    assert FIELDS["lora"].section == "llm" and FIELDS["lora"].default is None and "lora" in RESUME_FIXED
    assert lora.DEFAULTS["lora_alpha"] == 8  # PEFT's
