"""`gdpo-ray train` under `llm.lora` end to end (issue 30): the run's pushes carry the adapter
alone and are attested, `policy/` is a PEFT adapter directory that peft loads, `policy-merged/`
a plain model, `--resume` continues the adapter, and `gdpo-ray eval` takes the adapter."""

import json

import pytest

from gdpo_ray.run.cli import main

pytestmark = pytest.mark.slow  # each test a training run of its own (20-50 s on 2 cores)

LORA = "llm.lora={r: 8, lora_alpha: 16, target_modules: all-linear}"


def test_a_lora_run_pushes_its_adapter_exports_it_and_resumes(ray_cluster, tmp_path, capsys, monkeypatch):
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    common = [f"run.output_dir={tmp_path}", "training.prompts_per_step=4", "training.group_size=4",
              "generation.max_tokens=32", LORA, "training.lr=1e-3"]
    assert main(["train", "demo", "run.steps=3", "run.name=a", *common]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "a"
    assert f"policy (a PEFT LoRA adapter) {run / 'policy'}, merged into the base model" in out
    adapter = load_file(run / "policy" / "adapter_model.safetensors")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # every push carried exactly the adapter's float32 tensors, and was attested
    assert all(r["weights/push_bytes"] == sum(v.size * 4 for v in adapter.values()) for r in rows)
    assert [r["weights/attested"] >= r["step"] - 1 for r in rows] == [True] * 3
    config = json.loads((run / "policy" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    PeftModel.from_pretrained(base, str(run / "policy"))  # peft loads it as it is
    AutoModelForCausalLM.from_pretrained(run / "policy-merged")

    assert main(["train", "demo", "run.steps=4", *common, "--resume", "a"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # resumed without its adapter: refused before Ray, naming what differs
    code = main(["train", "demo", "run.steps=5", *common[:-2], "--resume", "a"])
    assert code == 2 and "llm.lora: the checkpoint was trained with {r: 8" in capsys.readouterr().err

    out_file = tmp_path / "report.json"
    assert main(["eval", str(run / "policy"), "--suite", "task:addition", "--limit", "4",
                 "--output", str(out_file)]) == 0
    report = json.loads(out_file.read_text())
    assert report["policy"] == str(run / "policy") and report["counts"]["items"] == 4
