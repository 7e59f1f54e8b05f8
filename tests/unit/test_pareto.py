"""Issue 51, per-objective evaluation: `gdpo-ray eval --compare` puts each reward column's mean
per run and checkpoint in a row (the in-training evals of metrics.jsonl, a checkpoint's report) and
recomputes `--correct` pass rates from the samples; `pareto_front` (pure: exact fronts with ties,
duplicates, NaN points, lower-is-better axes; equal to a plain loop); `gdpo-ray plot --pareto A B`
(points from eval reports, in-training evals or training rewards, the table with its pareto
column, the PNG). Column names hold a slash (a judge's criterion: `quality/helpful`)."""

import itertools
import json
import math
import random
import sys
from pathlib import Path

import pytest

from gdpo_ray.comparison import incomplete, pareto_front
from gdpo_ray.eval.report import build_report, metric_order, pass_rates, training_evals, write_report
from gdpo_ray.eval.correct import parse_correct
from gdpo_ray.eval.suite import Suite
from gdpo_ray.run.cli import main
from gdpo_ray.run.plot_command import pareto
from gdpo_ray.run.run_curves import EVAL_REPORT, IN_TRAINING, TRAINING_REWARDS, pareto_points
from tests.unit.test_plot import fake_run

NAN = math.nan


def front_by_loop(points, maximize):
    """The definition, pair by pair: p dominates q when at least as good everywhere, better once."""
    def better_or_equal(a, b, up):
        return a >= b if up else a <= b

    def dominates(p, q):
        return (all(better_or_equal(a, b, up) for a, b, up in zip(p, q, maximize))
                and any(a != b for a, b in zip(p, q)))

    complete = [i for i, p in enumerate(points) if not any(math.isnan(v) for v in p)]
    return [i for i in complete if not any(dominates(points[j], points[i]) for j in complete)]


def test_the_front_of_two_maximized_columns_with_a_duplicate_and_a_dominated_point():
    points = [(1, 1), (2, 0), (0, 2), (0.5, 0.5), (1, 1)]
    # (0.5, 0.5) is below (1, 1) on both; the two (1, 1) do not dominate each other: both on it
    assert pareto_front(points) == [0, 1, 2, 4]
    assert pareto_front(points) == front_by_loop(points, (True, True))


def test_a_tie_on_one_column_is_settled_by_the_other():
    # (1, 3) and (1, 2) tie on A: (1, 3) is better on B, so (1, 2) is dominated; (2, 2) dominates
    # it too; (1, 3) and (2, 2) each win one column: both on the front
    assert pareto_front([(1, 3), (1, 2), (2, 2)]) == [0, 2]
    # all equal: no point dominates another, every one is on the front
    assert pareto_front([(0.5, 0.5)] * 3) == [0, 1, 2]


def test_lower_is_better_on_one_axis():
    # (correct, length), length minimized: (0.6, 100) is as correct as (0.6, 200) and shorter,
    # more correct than (0.5, 100) at the same length, better on both than (0.4, 150)
    points = [(0.5, 100), (0.6, 200), (0.4, 150), (0.6, 100)]
    assert pareto_front(points, (True, False)) == [3]
    # maximized both ways, the longest is no longer dominated: (0.6, 200) beats (0.6, 100) on B
    assert pareto_front(points, (True, True)) == [1]
    # minimized both ways: (0.4, 150) is least correct; (0.5, 100) the shortest with (0.6, 100),
    # which it beats on A
    assert pareto_front(points, (False, False)) == [0, 2]


def test_nan_points_are_left_out_and_dominate_nothing():
    points = [(NAN, 5.0), (1.0, 1.0), (0.0, NAN), (NAN, NAN), (0.5, 0.5)]
    # a NaN point with B = 5 would dominate (1, 1) on B, were it compared: it is not
    assert pareto_front(points) == [1]
    assert incomplete(points) == [0, 2, 3]
    assert pareto_front([(NAN, NAN)]) == [] and incomplete([(NAN, NAN)]) == [0]
    # infinities are numbers: +inf dominates on its axis
    assert pareto_front([(math.inf, 0.0), (1.0, 0.0), (-math.inf, 1.0)]) == [0, 2]


def test_degenerate_inputs():
    assert pareto_front([]) == [] and incomplete([]) == []
    assert pareto_front([(3.0, 4.0)]) == [0]
    with pytest.raises(ValueError, match=r"takes \[n\]\[2\] points .* got shape \(2, 3\)"):
        pareto_front([(1, 2, 3), (1, 2, 3)])


def test_three_objectives():
    # (1, 1, 0) and (1, 0, 1) each win one objective; (0, 0, 0) is below both; (1, 1, 1) dominates
    # all three of them
    assert pareto_front([(1, 1, 0), (1, 0, 1), (0, 0, 0)], (True, True, True)) == [0, 1]
    assert pareto_front([(1, 1, 0), (1, 0, 1), (0, 0, 0), (1, 1, 1)], (True, True, True)) == [3]


@pytest.mark.parametrize("maximize", list(itertools.product((True, False), repeat=2)))
def test_the_vectorized_front_equals_the_definition_and_follows_a_permutation(maximize):
    rng = random.Random(51)
    # small integers: many ties and duplicates; more points than a block (1024); a few NaN
    points = [(rng.randint(0, 9), rng.choice([NAN] + list(range(10)))) for _ in range(2500)]
    front = pareto_front(points, maximize)
    assert front == front_by_loop(points, maximize) and front
    order = list(range(len(points)))
    rng.shuffle(order)
    shuffled = pareto_front([points[i] for i in order], maximize)
    assert sorted(order[i] for i in shuffled) == front


# -- gdpo-ray plot --pareto ---------------------------------------------------------------------

def report(suite, overall, step=None, settings=None):
    """A written report's fields that --pareto reads (its overall means; NaN written as null)."""
    return {"suite": suite, "policy": "p", "settings": settings or {"samples": 2}, "overall": overall,
            "categories": {}, "items": {}, "missing": {}, "errors": [],
            "counts": {"items": 1, "samples": 2, "prompt_too_long": 0}, **({"step": step} if step else {})}


@pytest.fixture
def sources(tmp_path):
    """A base model's report, and a run evaluated during training at steps 2 and 4 (the final
    report written at 4) on held-out rows scored by `correct` and a judge's `quality/helpful`."""
    base = write_report(report("rewards:held", {"correct": 0.25, "quality/helpful": 0.5}), tmp_path / "base.json")
    run = fake_run(tmp_path, "gdpo-1", [
        {"step": 1, "rewards/correct/mean": 0.1, "rewards/quality/helpful/mean": 0.4},
        {"step": 2, "rewards/correct/mean": 0.3, "rewards/quality/helpful/mean": 0.5,
         "eval/rewards:held/correct": 0.5, "eval/rewards:held/quality/helpful": 0.25},
        {"step": 3, "rewards/correct/mean": 0.4, "rewards/quality/helpful/mean": 0.6},
        {"step": 4, "rewards/correct/mean": 0.6, "rewards/quality/helpful/mean": 0.7,
         "eval/rewards:held/correct": 0.75, "eval/rewards:held/quality/helpful": 0.375},
    ])
    write_report(report("rewards:held", {"correct": 0.75, "quality/helpful": 0.375}, step=4),
                 run / "eval" / "rewards_held.json")
    return base, run


def test_points_are_each_runs_checkpoints_from_eval_reports(sources):
    points = pareto_points(sources, ["correct", "quality/helpful"])
    assert [(p.label, p.values, p.source) for p in points] == [
        ("base", (0.25, 0.5), EVAL_REPORT),
        ("gdpo-1 step 2", (0.5, 0.25), IN_TRAINING),  # metrics.jsonl: no report was written of it
        ("gdpo-1 step 4", (0.75, 0.375), EVAL_REPORT),  # the final report (the same numbers logged)
    ]
    # the base is best on quality/helpful, step 4 on correct; step 2 is below step 4 on both
    assert pareto_front([p.values for p in points]) == [0, 2]


def documented(command):
    """The output docs/evaluation.md shows under ``$ command`` (its indented block)."""
    lines = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text().splitlines()
    start = lines.index(f"    $ {command}") + 1
    end = next(i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith("    "))
    block = [line[4:] for line in lines[start:end]]
    while block and not block[-1]:
        block.pop()
    return block


def test_the_command_prints_the_table_and_writes_the_png(sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the folder it runs in on it
    out = tmp_path / "figs" / "pareto.png"
    assert main(["plot", "--pareto", "correct", "quality/helpful", *map(str, sources), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed[:-1] == documented("gdpo-ray plot --pareto correct quality/helpful base.json runs/gdpo-1 "
                                      "--output pareto.png")[:-1]
    assert printed == [
        "pareto: correct (higher is better) against quality/helpful (higher is better); 2 of 3 points non-dominated",
        "point          source            correct  quality/helpful  pareto",
        "-------------  ----------------  -------  ---------------  ------",
        "base           eval report         0.250            0.500     yes",
        "gdpo-1 step 2  in-training eval    0.500            0.250      no",
        "gdpo-1 step 4  eval report         0.750            0.375     yes",
        f"plot written to {out}"]


def test_lower_is_better_on_a_minimized_column(sources, tmp_path):
    points, front, text = pareto(sources, ["correct", "quality/helpful"], minimize=["quality/helpful"],
                                 out=tmp_path / "p.png")
    # lower quality/helpful is better now: step 2 (0.5, 0.25) is no longer dominated by step 4
    # (0.75, 0.375); the base (0.25, 0.5) is below step 2 on both counts
    assert front == [1, 2]
    assert text.splitlines()[0] == ("pareto: correct (higher is better) against quality/helpful (lower is "
                                    "better); 2 of 3 points non-dominated")
    with pytest.raises(ValueError, match=r"--minimize 'length' is not a --pareto column \(correct or quality/helpful\)"):
        pareto(sources, ["correct", "quality/helpful"], minimize=["length"], out=tmp_path / "p.png")


def test_a_run_without_evals_gives_its_training_rewards_said_as_such(sources, tmp_path):
    base, run = sources
    plain = fake_run(tmp_path, "grpo-1", [
        {"step": 1, "rewards/correct/mean": 0.2, "rewards/quality/helpful/mean": 0.9},
        {"step": 2, "rewards/correct/mean": 0.8, "rewards/quality/helpful/mean": NAN},  # a failed judge
    ])
    points, front, text = pareto([base, plain], ["correct", "quality/helpful"], out=tmp_path / "p.png")
    assert [(p.label, p.source) for p in points] == [
        ("base", EVAL_REPORT), ("grpo-1 step 1", TRAINING_REWARDS), ("grpo-1 step 2", TRAINING_REWARDS)]
    assert front == [0, 1]  # step 2 is left out (no quality/helpful), not on the front
    lines = text.splitlines()
    assert lines[0].endswith("; 2 of 2 points non-dominated")
    assert lines[5].split() == ["grpo-1", "step", "2", "training", "rewards", "0.800", "-", "-"]
    assert lines[6:] == ["left out (no value of correct or quality/helpful there): grpo-1 step 2",
                         "note: training rewards (batch means of training prompts) sit beside eval means "
                         "(held-out prompts): they do not compare like for like"]
    # --training: the evaluated run's training rewards instead of its evals, one point per step
    trained = pareto_points([run], ["correct", "quality/helpful"], training=True)
    assert [(p.label, p.values) for p in trained] == [
        ("gdpo-1 step 1", (0.1, 0.4)), ("gdpo-1 step 2", (0.3, 0.5)), ("gdpo-1 step 3", (0.4, 0.6)),
        ("gdpo-1 step 4", (0.6, 0.7))]
    assert {p.source for p in trained} == {TRAINING_REWARDS}
    # any metrics.jsonl key is a column of the training rewards too (a length, minimized)
    assert pareto_points([run], ["correct", "rewards/correct/mean"], training=True)[0].values == (0.1, 0.1)


def test_a_missing_column_names_the_columns_there_are(sources, tmp_path, capsys):
    assert main(["plot", "--pareto", "correct", "quality/helpfull", *map(str, sources),
                 "--output", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        "gdpo-ray plot: --pareto 'quality/helpfull': no run or report has it; the columns of the eval "
        "reports: correct, quality/helpful; of the in-training evals: correct, quality/helpful")
    assert not (tmp_path / "p.png").exists()
    plain = fake_run(tmp_path, "grpo-1", [{"step": 1, "rewards/correct/mean": 0.2}])
    with pytest.raises(ValueError, match=r"the columns of the training rewards: correct \(or any key of metrics.jsonl\)"):
        pareto_points([plain], ["correct", "length"])


def test_a_column_two_suites_report_is_named_by_its_suite(tmp_path):
    run = fake_run(tmp_path, "r", [{"step": 2, "eval/task:addition/exceed_ratio": 0.5,
                                    "eval/rewards:held/exceed_ratio": 0.25, "eval/rewards:held/correct": 1.0}])
    with pytest.raises(ValueError, match=r"suites task:addition, rewards:held of .* both report it; name one, "
                                         r"e.g. task:addition/exceed_ratio"):
        pareto_points([run], ["correct", "exceed_ratio"])
    (point,) = pareto_points([run], ["correct", "rewards:held/exceed_ratio"])
    assert point.values == (1.0, 0.25) and point.label == "r step 2"


def test_misused_options_are_refused(sources, capsys):
    assert main(["plot", str(sources[1]), "--minimize", "correct"]) == 2
    assert "--minimize goes with --pareto A B" in capsys.readouterr().err
    assert main(["plot", "--pareto", "correct", "correct", str(sources[1])]) == 2
    assert "--pareto takes two different columns; got correct and correct" in capsys.readouterr().err
    assert main(["plot", "--pareto", "a", "b", str(sources[1].parent / "nowhere")]) == 2
    assert "nowhere does not exist; give a run directory" in capsys.readouterr().err
    not_a_report = sources[1].parent / "x.json"
    not_a_report.write_text(json.dumps({"a": 1}))
    assert main(["plot", "--pareto", "a", "b", str(not_a_report)]) == 2
    assert "not an eval report" in capsys.readouterr().err


# -- gdpo-ray eval --compare, per column and checkpoint ---------------------------------------------

class Columns(Suite):
    """The layout of a rewards suite's report: two reward columns, one a judge's criterion."""

    name = "rewards:held"
    metrics = ("correct", "correct/failure_rate", "quality/helpful", "quality/helpful/failure_rate",
               "weighted_sum", "exceed_ratio")

    def all_items(self):
        return []

    def score(self, item, completions):
        return []


def columns_report(correct, helpful, step=None):
    """One item, a sample per (correct, helpful) pair; a NaN helpful is a judge that failed."""
    samples = [{"correct": c, "correct/failure_rate": 0.0, "quality/helpful": h,
                "quality/helpful/failure_rate": float(math.isnan(h)), "weighted_sum": c + h,
                "exceed_ratio": 0.0} for c, h in zip(correct, helpful)]
    out = build_report(Columns(), {"0": samples}, {"0": "held"}, "p", {"samples": len(samples)})
    return out | ({"step": step} if step is not None else {})


@pytest.fixture
def evaluated(tmp_path, monkeypatch):
    """base.json (the base model) and run/ (evaluated during training at steps 2 and 4, its final
    report of step 4 written), as a user's folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the folder it runs in on it
    # base: correct 0, 1 -> 0.5; helpful 0.25, 0.75 -> 0.5; weighted 0.25, 1.75 -> 1.0
    write_report(columns_report([0.0, 1.0], [0.25, 0.75]), "base.json")
    fake_run(tmp_path, "run", [
        {"step": 2, "eval/rewards:held/correct": 0.5, "eval/rewards:held/correct/failure_rate": 0.0,
         "eval/rewards:held/quality/helpful": 0.25, "eval/rewards:held/quality/helpful/failure_rate": 0.0,
         "eval/rewards:held/weighted_sum": 0.75, "eval/rewards:held/exceed_ratio": 0.0},
        {"step": 3, "rewards/correct/mean": 1.0},
        {"step": 4, "eval/rewards:held/correct": 1.0, "eval/rewards:held/quality/helpful": 0.5}])
    # step 4: correct 1, 1 -> 1.0; helpful 0.5 and a failed judge -> 0.5 over 1 sample, failure 0.5;
    # weighted 1.5 and NaN -> 1.5
    write_report(columns_report([1.0, 1.0], [0.5, NAN], step=4), "run/eval/rewards_held.json")
    return tmp_path


def test_compare_gives_a_row_per_column_and_a_column_per_checkpoint(evaluated, capsys):
    assert main(["eval", "--compare", "base.json", "run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == documented("gdpo-ray eval --compare base.json run")  # the docs show it
    assert printed == [
        "rewards:held                  base.json             run",
        "                                      -  step 2  step 4",
        "----------------------------  ---------  ------  ------",
        "correct                           0.500   0.500   1.000",
        "quality/helpful                   0.500   0.250   0.500",
        "weighted_sum                      1.000   0.750   1.500",
        "exceed_ratio                      0.000   0.000   0.000",
        "correct/failure_rate              0.000   0.000   0.000",
        "quality/helpful/failure_rate      0.000   0.000   0.500",
        "",
        "from metrics.jsonl (in-training evals, the run's training.eval_* settings; no report was written "
        "of them): run step 2",
        "",
        "settings",
        "run               suite  step  samples",
        "---------  ------------  ----  -------",
        "base.json  rewards:held     -        2",
        "run        rewards:held     4        2"]


def test_compare_recomputes_the_pass_rates_of_correct_from_the_samples(evaluated, capsys):
    assert main(["eval", "--compare", "base.json", "run", "--correct", "quality/helpful>=0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # base: 0.25 fails, 0.75 passes -> 0.5; step 4: 0.5 passes, the failed judge fails -> 0.5;
    # step 2 has no samples (metrics.jsonl): '-'
    assert lines[5] == "quality/helpful/pass_rate         0.500       -   0.500"
    assert lines[-1] == ("--correct quality/helpful>=0.5: each NAME/pass_rate above is recomputed from the "
                         "report's samples (a report's own, made with other conditions, replaced); no samples "
                         "to recompute from (in-training evals keep none): run step 2")
    assert main(["eval", "--compare", "base.json", "--correct", "helpful>=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gdpo-ray eval: --correct 'helpful>=1': 'helpful' is not a metric of the reports' samples; its "
        "metrics: correct, correct/failure_rate, quality/helpful, quality/helpful/failure_rate, weighted_sum, "
        "exceed_ratio")


def test_pass_rates_are_avg_at_n_then_the_mean_over_items():
    samples = {"a": [{"correct": 1.0, "quality/helpful": 0.5}, {"correct": 0.0, "quality/helpful": 1.0}],
               "b": [{"correct": 1.0, "quality/helpful": None}, {"correct": 1.0, "quality/helpful": 0.0},
                     {"correct": 0.0, "quality/helpful": 1.0}, {"correct": 1.0, "quality/helpful": 1.0}]}
    report = {"suite": "rewards:held", "overall": {"correct": 0.7, "quality/helpful": 0.6},
              "items": {k: {"samples": v} for k, v in samples.items()}}
    conditions = parse_correct(["correct>=1", "quality/helpful>0.5", "length<=100"],
                               ["correct", "quality/helpful", "length"])
    # correct: a 1/2, b 3/4 -> (0.5 + 0.75) / 2 = 0.625; helpful > 0.5: a 1/2 (0.5 is not > 0.5),
    # b: null (a failed judge) fails, 0 fails, 1 and 1 pass -> 2/4; (0.5 + 0.5) / 2 = 0.5; length is
    # no metric of this report: left out
    assert pass_rates(report, conditions) == {"correct/pass_rate": 0.625, "quality/helpful/pass_rate": 0.5}
    assert pass_rates({"overall": {"correct": 1.0}, "suite": "s"}, conditions) == {}  # no samples


def test_in_training_evals_are_read_from_metrics_rows():
    rows = [{"step": 1, "rewards/correct/mean": 0.5},
            {"step": 2, "time": 9.0, "eval/rewards:held/quality/helpful": 0.25,
             "eval/rewards:held/quality/helpful/pass_rate": 1.0, "eval/task:addition/pass@1": 0.5,
             "timing/eval_s": 3.0},
            {"step": 4, "eval/rewards:held/quality/helpful": 0.75, "eval/rewards:held/correct": NAN}]
    # eval/<suite>/<metric>: the suite up to the first "/", the metric all the rest
    first, second, third = training_evals(rows)
    assert first == {"suite": "rewards:held", "step": 2, "source": "metrics.jsonl",
                     "overall": {"quality/helpful": 0.25, "quality/helpful/pass_rate": 1.0}}
    assert second == {"suite": "task:addition", "step": 2, "source": "metrics.jsonl", "overall": {"pass@1": 0.5}}
    assert third["step"] == 4 and third["overall"]["quality/helpful"] == 0.75
    assert math.isnan(third["overall"]["correct"])  # shown as '-'
    assert training_evals([{"step": 1, "rewards/correct/mean": 0.5}]) == []


def test_the_rows_put_each_reward_columns_mean_first_then_the_pass_rates():
    metrics = ["correct", "correct/failure_rate", "quality/helpful", "quality/helpful/failure_rate",
               "weighted_sum", "exceed_ratio", "rollout/turns", "accuracy", "quality/helpful/pass_rate", "pass@2"]
    assert metric_order(metrics) == [
        "correct", "quality/helpful", "accuracy", "quality/helpful/pass_rate", "pass@2", "weighted_sum",
        "exceed_ratio", "rollout/turns", "correct/failure_rate", "quality/helpful/failure_rate"]
    assert metric_order(["pass@1", "format_ratio", "exceed_ratio"]) == ["pass@1", "format_ratio", "exceed_ratio"]


def test_a_checkpoints_report_is_written_beside_its_runs_as_that_step(evaluated):
    from gdpo_ray.run.checkpoints import COMPLETE_MARKER
    from gdpo_ray.run.eval_command import checkpoint_step, default_output, reports_of

    checkpoint = evaluated / "run" / "checkpoints" / "step_000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / COMPLETE_MARKER).write_text("complete: policy_version 10\n")
    assert checkpoint_step(str(checkpoint)) == 10 and checkpoint_step("demo") is None
    assert checkpoint_step(str(evaluated / "run")) is None  # a run directory: its policy/, no step
    assert default_output(str(checkpoint), "rewards:held", 10) == evaluated / "run" / "eval" / "rewards_held@step_10.json"
    assert default_output(str(evaluated / "run"), "rewards:held") == evaluated / "run" / "eval" / "rewards_held.json"
    write_report(columns_report([0.0], [1.0], step=10), default_output(str(checkpoint), "rewards:held", 10))
    assert [(r.get("source"), r.get("step")) for r in reports_of("run")] == [
        (None, 4), (None, 10), ("metrics.jsonl", 2)]
