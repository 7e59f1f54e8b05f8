"""`gdpo-ray eval` end to end on the session's Ray cluster: the demo's policy on a few items of
every suite (hf engine, tiny budgets), generated on a rollout actor and scored."""

import json

import pytest

from gdpo_ray.run.eval_runner import evaluate
from gdpo_ray.eval.suites import make_suite

pytestmark = pytest.mark.slow  # each test a training run of its own (20-50 s on 2 cores)


@pytest.fixture(scope="module")
def demo_rollouts(ray_cluster):
    """One rollout actor of the demo's policy, without rewards, in the group that schedules it."""
    from actors.rollout_group import RolloutGroup
    from gdpo_ray.models.demo import demo_model_dir

    rollouts = RolloutGroup(dict(model_path=str(demo_model_dir()), rewards=None, group_size=2,
                                 max_prompt_tokens=8192), num_actors=1, prompts=None, buffer=None)
    yield rollouts
    rollouts.shutdown()


@pytest.mark.parametrize("spec", ["task:addition", "task:tool_calls", "task:code", "humaneval", "math",
                                  "bfcl:simple_python", "bfcl:live_irrelevance"])
def test_every_suite_evaluates_the_demo_policy(demo_rollouts, tmp_path, spec):
    if spec == "math":
        path = tmp_path / "mini.jsonl"
        path.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                                for a in range(3)))
        spec = f"math:{path}"
    if spec.startswith("bfcl"):
        pytest.importorskip("bfcl_eval", reason="pip install --no-deps bfcl-eval==2026.3.23")
    suite = make_suite(spec)
    report = evaluate(suite, rollouts=demo_rollouts, samples=2, max_tokens=8, limit=2, progress=False)
    assert report["counts"] == {"items": 2, "samples": 4, "prompt_too_long": 0}
    assert list(report["overall"]) == list(suite.metrics)
    for item in report["items"].values():
        assert len(item["samples"]) == 2
        for s in item["samples"]:
            assert isinstance(s["completion"], str) and 0 < s["tokens"] <= 8
            assert s["finish_reason"] in ("stop", "length")
            assert all(s[m] in (0.0, 1.0) for m in suite.metrics)  # every sample scored
    assert report["settings"] | {"samples": 2, "max_tokens": 8, "limit": 2} == report["settings"]


def test_the_demo_learns_addition_as_eval_measures_it(demo_rollouts):
    """Sampling at the demo's temperature, the warm-started policy answers some sums: the
    eval sees what training rewards see (pass@1 > 0, format > 0)."""
    report = evaluate(make_suite("task:addition"), rollouts=demo_rollouts, samples=4, temperature=1.0,
                      top_p=1.0, limit=20, progress=False)
    assert 0 < report["overall"]["pass@1"] < 1 and 0 < report["overall"]["format_ratio"] < 1


def test_the_eval_command_generates_with_rollout_actors(ray_cluster, tmp_path, capsys):
    from gdpo_ray.run.cli import main

    out = tmp_path / "r.json"
    assert main(["eval", "demo", "--suite", "task:addition", "--limit", "3", "--samples", "2",
                 "--max-tokens", "8", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["policy"] == "demo" and report["counts"] == {"items": 3, "samples": 6, "prompt_too_long": 0}
    assert report["settings"]["engine"] == "hf"
    printed = capsys.readouterr().out
    assert "task:addition" in printed and f"report {out}" in printed


def test_a_run_evaluates_during_training_and_its_checkpoint_evaluates_as_its_policy(ray_cluster, tmp_path, capsys):
    """training.eval_every: eval/<suite>/<metric> at the eval steps only (JSONL and
    TensorBoard; training.eval_pass_k: pass@k among them), the final report in the run's eval/, a panel in the plot; then the run's
    checkpoint and its exported policy/ evaluate alike (same weights, same sampling seed), and
    --compare reads run directories."""
    from gdpo_ray.run.cli import main

    assert main(["train", "demo", "run.steps=3", "run.name=evald", f"run.output_dir={tmp_path}",
                 "training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=32",
                 "training.eval_every=2", "training.eval_suite=task:addition", "training.eval_limit=6",
                 "training.eval_samples=2", "training.eval_pass_k=[1,2]"]) == 0
    run = tmp_path / "evald"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows}
    assert list(evals[1]) == [] and list(evals[3]) == []  # evaluated at step 2 only ...
    assert sorted(evals[2]) == ["eval/task:addition/exceed_ratio", "eval/task:addition/format_ratio",
                                "eval/task:addition/pass@1", "eval/task:addition/pass@2"]
    # pass@2 >= pass@1: a correct one among 2 samples is at least as likely as in 1
    assert evals[2]["eval/task:addition/pass@2"] >= evals[2]["eval/task:addition/pass@1"]
    final = json.loads((run / "eval" / "task_addition.json").read_text())  # ... and at the end
    assert final["step"] == 3 and final["counts"] == {"items": 6, "samples": 12, "prompt_too_long": 0}
    assert final["settings"]["pass_k"] == [1, 2] and "pass@2" in final["overall"]
    assert "eval report" in capsys.readouterr().out
    by_checkpoint, by_policy = tmp_path / "c.json", tmp_path / "p.json"
    for policy, out in ((run / "checkpoints" / "final", by_checkpoint), (run / "policy", by_policy)):
        assert main(["eval", str(policy), "--suite", "task:addition", "--limit", "8", "--samples", "2",
                     "--max-tokens", "16", "--output", str(out)]) == 0
    a, b = (json.loads(p.read_text()) for p in (by_checkpoint, by_policy))
    assert a["items"] == b["items"] and a["overall"] == b["overall"]
    capsys.readouterr()
    assert main(["eval", "--compare", str(run), str(by_policy)]) == 0
    table = capsys.readouterr().out.splitlines()
    # a column per checkpoint: step 2 from metrics.jsonl, step 3 the final report; the policy's own
    assert table[0].split() == ["task:addition", str(run), str(by_policy)]
    assert table[1].split() == ["step", "2", "step", "3", "-"]
    assert [line.split()[0] for line in table[3:7]] == ["pass@1", "pass@2", "format_ratio", "exceed_ratio"]
    assert table[7:9] == ["", f"from metrics.jsonl (in-training evals, the run's training.eval_* settings; no "
                              f"report was written of them): {run} step 2"] and table[10] == "settings"
    # the in-training eval (6 items, the suite's max_tokens) and this one (8 items, 16): said
    assert any(line.startswith("warning: task:addition max_tokens differs: ") for line in table)


def test_prompts_over_the_limit_are_counted_not_generated(ray_cluster):
    """A BFCL live_multiple prompt (its system prompt lists every function doc) is over 64
    tokens: not generated, scored as the empty answer it is, counted; the run goes on."""
    pytest.importorskip("bfcl_eval", reason="pip install --no-deps bfcl-eval==2026.3.23")
    report = evaluate(make_suite("bfcl:live_multiple"), policy="demo", limit=2, samples=2, max_tokens=4,
                      max_prompt_tokens=64, progress=False)
    assert report["counts"] == {"items": 2, "samples": 4, "prompt_too_long": 4}
    assert report["overall"] == {"accuracy": 0.0, "format_ratio": 0.0}
    assert all(s["finish_reason"] == "prompt_too_long" and s["completion"] == "" and s["tokens"] == 0
               for item in report["items"].values() for s in item["samples"])


def test_an_actor_killed_during_an_eval_is_replaced_and_its_prompts_completed(ray_cluster):
    """Evaluation is scheduled by the RolloutGroup, so it survives a dead actor as training
    does: the actor dies after the first call returns; a fresh one completes the rest."""
    from actors.rollout_group import RolloutGroup
    from gdpo_ray.models.demo import demo_model_dir

    rollouts = RolloutGroup(dict(model_path=str(demo_model_dir()), rewards=None, group_size=2),
                            num_actors=1, prompts=None, buffer=None, prompts_per_call=1, calls_per_actor=1)
    done = []

    def kill_after_the_first(k):
        done.append(k)
        if len(done) == 1:
            ray_cluster.kill(rollouts.slots[0].handle)

    try:
        prompts = [f"What is {a} + 1?" for a in range(4)]
        out = rollouts.complete(prompts, 2, {"max_tokens": 4}, progress=kill_after_the_first)
    finally:
        rollouts.shutdown()
    assert len(out) == 4 and all(len(samples) == 2 for samples in out)
    assert all(0 < s.tokens <= 4 and s.messages is None for samples in out for s in samples)
    assert rollouts.stats["actor_restarts"] == 1 and sum(done) == 4


def test_a_run_evaluates_its_own_rewards_on_held_out_prompts(ray_cluster, tmp_path, capsys):
    """training.eval_suite: rewards:FILE scores held-out rows with the run's training.rewards
    during training; `gdpo-ray eval RUN --suite rewards:FILE` does the same after it, with the
    run's data.system_prompt (recorded in the report's settings)."""
    from gdpo_ray.run.cli import main

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "ground_truth": str(a + b)}) + "\n"
                                for a, b in [(1, 1), (2, 5), (4, 4), (9, 0)]))
    assert main(["train", "demo", "run.steps=2", "run.name=own", f"run.output_dir={tmp_path}",
                 "training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=32",
                 "training.eval_every=2", f"training.eval_suite=rewards:{held_out}", "training.eval_samples=2",
                 "data.system_prompt=Add the numbers.", "run.export_policy=true"]) == 0
    run = tmp_path / "own"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(k.removeprefix("eval/rewards:held_out/") for k in rows[1] if k.startswith("eval/")) == [
        "correct", "correct/failure_rate", "exceed_ratio", "format", "format/failure_rate",
        "length", "length/failure_rate", "weighted_sum"]
    capsys.readouterr()
    out = tmp_path / "after.json"
    assert main(["eval", str(run), "--suite", f"rewards:{held_out}", "--samples", "2", "--max-tokens", "32",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["system_prompt"] == "Add the numbers." and report["counts"]["items"] == 4
    assert 0 <= report["overall"]["correct"] <= 1 and report["overall"]["correct/failure_rate"] == 0
