"""`gdpo-ray train` end to end, in-process on the session's Ray cluster: the run directory holds
the metrics (JSONL + TensorBoard), the reward plot, a checkpoint and the exported policy, and
`--resume` continues from that checkpoint."""

import json

from gdpo_ray.run.cli import main


def test_train_writes_the_run_directory_and_resumes(ray_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
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

    assert all(r["learner/lr"] == 2e-4 for r in rows)  # the demo's
    checkpoint = run / "checkpoints" / "final"
    # a resumed run keeps the checkpoint's state (step, weights, optimizer, prompts) and takes
    # this command's settings: here a lower learning rate
    # (the README's form: a relative checkpoint path, overrides before and after it)
    assert main(["train", "demo", "run.steps=3", *common, "--resume", "first/checkpoints/final",
                 "run.name=second", "training.lr=5e-5"]) == 0
    assert "resuming with lr 0.0002 -> 5e-05" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3] and rows[0]["learner/lr"] == 5e-5
    # other data would make the saved prompt state point at other rows: refused before Ray starts
    assert main(["train", "demo", "run.steps=4", "data.num_prompts=50", *common,
                 "--resume", str(checkpoint)]) == 2
    assert "data.num_prompts was None and is 50 now" in capsys.readouterr().err
    # a run name in use is refused, before Ray (the first run's files stay as they are)
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", "demo", "run.steps=1", "run.name=first", *common]) == 2
    assert "exists already (run.name='first')" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before
