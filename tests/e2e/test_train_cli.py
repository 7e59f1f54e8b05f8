"""`gdpo-ray train` end to end, in-process on the session's Ray cluster: the run directory holds
the metrics (JSONL + TensorBoard), the reward plot, a checkpoint and the exported policy, and
`--resume` continues from that checkpoint."""

import json

from gdpo_ray.cli import main


def test_train_writes_the_run_directory_and_resumes(ray_cluster, tmp_path, capsys):
    common = [f"run.output_dir={tmp_path}", "training.prompts_per_step=4",
              "training.group_size=4", "generation.max_tokens=32"]
    assert main(["train", "demo", "run.steps=2", "run.name=first", *common]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "first"
    assert f"run directory {run}" in out and "reward" in out and "format" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("format", "correct", "length"):
        assert all(f"rewards/{name}/mean" in r and f"adv/{name}/std" in r for r in rows)
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert (run / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run / "policy")
    AutoTokenizer.from_pretrained(run / "policy")

    checkpoint = run / "checkpoints" / "final"
    assert main(["train", "demo", "run.steps=3", "run.name=second", *common,
                 "--resume", str(checkpoint)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3]
