"""`gdpo-ray train` end to end, in-process on the session's Ray cluster: the run directory holds
the metrics (JSONL + TensorBoard), the reward plot, a checkpoint and the exported policy, and
`--resume` continues from that checkpoint."""

import json

import pytest

from gdpo_ray.run.cli import main

pytestmark = pytest.mark.slow  # each test a training run of its own (20-50 s on 2 cores)


def test_train_writes_the_run_directory_and_resumes(ray_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    common = [f"run.output_dir={tmp_path}", "training.prompts_per_step=4",
              "training.group_size=4", "generation.max_tokens=32"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["train", "demo", "run.steps=2", "run.name=first", *common, "training.log_completions=3",
                 "run.loggers=[jsonl,tensorboard,wandb,mlflow]", "training.checkpoint_every=1",
                 "training.keep_checkpoints=1"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "first"
    assert f"run directory {run}" in out and "reward" in out and "format" in out
    assert "steps 1-3" not in out and "step 1  step 2" in out.replace("   ", "  ")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # metrics only (the config is config.yaml, a preset of this run), throughput per step
    assert not any(k.startswith(("config/", "timers/")) or k == "training_iteration" for r in rows for k in r)
    assert all(r["throughput/samples_per_s"] == 16 / r["timing/step_s"] for r in rows)
    from gdpo_ray.run.presets import load_preset

    saved = load_preset(str(run / "config.yaml"))
    assert saved["training"]["log_completions"] == 3 and saved["run"]["name"] == "first"
    assert saved["training"]["checkpoint_dir"] is None and saved["generation"]["max_tokens"] == 32
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    assert all(s["prompt"].startswith("<|im_start|>") and {"rewards/format", "advantage", "finish_reason"} <= set(s)
               for s in samples)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final", "step_000002"]
    assert len(list((run / "wandb").glob("offline-run-*/*.wandb"))) == 1
    assert list((run / "mlruns").glob("*/*/metrics/rewards/format/mean"))
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
    # --resume RUN_DIR goes on in that directory, and in its wandb and MLflow runs (issue 48)
    assert main(["train", "demo", "run.steps=3", *common, "run.loggers=[jsonl,tensorboard,wandb,mlflow]",
                 "--resume", "first"]) == 0
    folders = sorted((run / "wandb").glob("offline-run-*"))  # one per opening, one run id: one run when synced
    assert len(folders) == 2 and len({f.name.rsplit("-", 1)[1] for f in folders}) == 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    [mlflow_run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(mlflow_run.info.run_id, "rewards/format/mean")
    assert [m.step for m in history] == [1, 2, 3] and mlflow_run.info.status == "FINISHED"


def test_a_learner_death_and_a_full_disk_under_gdpo_ray_train(ray_cluster, tmp_path, capsys, monkeypatch):
    """Issue 29 items 2, 11 and 12, as `gdpo-ray train` meets them: `--resume RUN_DIR` goes on in
    that directory, appending its metrics; a learner killed there makes the algorithm restore
    the checkpoint the run resumed from (not the start of the run) and redo the steps since, and
    the command goes on, each step logged once (issue 50: the step that trained nothing logs no
    row, and the step redone on the way is not logged again); then the final
    checkpoint meets a full disk: a message naming it, exit 1, no traceback, the older
    checkpoint at that path intact."""
    import errno
    import os

    from gdpo_ray.run.algorithm import GDPO
    from gdpo_ray.run.checkpoints import checkpoint_version, verify_checkpoint
    from learners.learner_group import LearnerGroup

    monkeypatch.chdir(tmp_path)
    common = [f"run.output_dir={tmp_path}", "training.prompts_per_step=4", "training.group_size=4",
              "generation.max_tokens=32", "run.export_policy=false"]
    assert main(["train", "demo", "run.steps=2", "run.name=a", *common]) == 0
    run, final = tmp_path / "a", tmp_path / "a" / "checkpoints" / "final"
    capsys.readouterr()
    update, killed = GDPO._update, []

    def update_after_a_learner_died(self, groups, advantages):  # in step 4 (policy version 3)
        if self.policy_version == 3 and not killed:
            killed.append(ray_cluster.kill(self.learners.learners[0]))
        return update(self, groups, advantages)

    def full_disk(self, path):  # what a learner's save raises when the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GDPO, "_update", update_after_a_learner_died)
    monkeypatch.setattr(LearnerGroup, "save_checkpoint", full_disk)
    assert main(["train", "demo", "run.steps=4", *common, "--resume", "a"]) == 1
    captured = capsys.readouterr()
    assert f"resuming from {final} (continuing the run in its directory)" in captured.out
    assert ("a learner died in step 4; new learners took over from step 2 (the last checkpoint, or the "
            "start) and redid steps 3-4") in captured.err
    assert f"cannot write the checkpoint {final}: [Errno 28] No space left on device" in captured.err
    assert f"last complete checkpoint {final}" in captured.err
    assert f"--resume {run}" in captured.err and "Traceback" not in captured.err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # 1, 2 (the first run); 3, then 4 failed and went back to 2 (no row); 3 again (no row), 4
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["learner_recoveries"] for r in rows] == [0, 0, 0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["final"]  # no partial save
    assert verify_checkpoint(str(final)) == [] and checkpoint_version(final) == 2
