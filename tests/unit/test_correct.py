"""``--correct 'NAME>=VALUE'``: a correct sample of any suite from its metrics, with exact
accuracy, per-column pass rates and pass@k; refused where it cannot mean anything."""

import math

import pytest

from gdpo_ray.eval.correct import Condition, correct_metrics, judge, parse_correct
from gdpo_ray.eval.report import build_report
from gdpo_ray.eval.suites import make_suite
from tests.unit.test_eval_rewards_suite import REWARDS, write_jsonl

METRICS = ("answer", "state", "rollout/tool_errors")


def test_conditions_parse_and_judge_each_sample():
    conditions = parse_correct(["answer>=1", " state > 0.5 ", "rollout/tool_errors<1", "state<=2"], METRICS)
    assert conditions == (Condition("answer", ">=", 1.0), Condition("state", ">", 0.5),
                          Condition("rollout/tool_errors", "<", 1.0), Condition("state", "<=", 2.0))
    assert [str(c) for c in conditions] == ["answer>=1", "state>0.5", "rollout/tool_errors<1", "state<=2"]
    assert correct_metrics(conditions) == ("accuracy", "answer/pass_rate", "state/pass_rate",
                                           "rollout/tool_errors/pass_rate")
    solved = {"answer": 1.0, "state": 1.0, "rollout/tool_errors": 0.0}
    assert judge(conditions, solved) == {"accuracy": 1.0, "answer/pass_rate": 1.0, "state/pass_rate": 1.0,
                                         "rollout/tool_errors/pass_rate": 1.0}
    # state 3 passes its first condition (> 0.5), fails its second (<= 2): the column fails
    assert judge(conditions, solved | {"state": 3.0}) == {"accuracy": 0.0, "answer/pass_rate": 1.0,
                                                          "state/pass_rate": 0.0, "rollout/tool_errors/pass_rate": 1.0}
    # a reward that could not be computed never counts as solved
    assert judge(conditions, solved | {"answer": math.nan})["answer/pass_rate"] == 0.0
    assert judge(parse_correct("answer==0.5", METRICS), {"answer": 0.5}) == {"accuracy": 1.0, "answer/pass_rate": 1.0}


@pytest.mark.parametrize("texts, message", [
    (["answer=>1"], "write NAME OP VALUE"),
    (["answer>=yes"], "'yes' is not a number"),
    (["anwser>=1"], "'anwser' is not a metric of this suite; its metrics: answer, state"),
    ([], "one or more conditions"),
])
def test_bad_conditions_are_named(texts, message):
    with pytest.raises(ValueError, match=message):
        parse_correct(texts, METRICS)


def test_a_suite_gets_accuracy_pass_rates_and_pass_at_k_from_its_columns(tmp_path):
    rows = [{"prompt": "2+2?", "answer": "4"}]
    suite = make_suite(f"rewards:{write_jsonl(tmp_path / 'h.jsonl', rows)}", rewards=REWARDS)
    assert suite.correct_metric() is None
    suite.set_correct(["correct>=1", "flaky>=0.25"])
    assert suite.correct_metric() == "accuracy" and suite.metrics[-3:] == ("accuracy", "correct/pass_rate",
                                                                           "flaky/pass_rate")
    # 4 samples: 2 solved -> accuracy 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6
    samples = [{"correct": c, "flaky": 0.25} for c in (1.0, 0.0, 1.0, 0.0)]
    scored = suite.judged(samples)
    report = build_report(suite, {"0": [s | {m: 0.0 for m in suite.metrics if m not in s} | s for s in scored]},
                          {"0": "h"}, "p", {}, pass_k=(1, 2))
    assert report["overall"]["accuracy"] == 0.5 and report["overall"]["pass@1"] == 0.5
    assert report["overall"]["pass@2"] == pytest.approx(1 - 1 / 6)
    assert report["overall"]["correct/pass_rate"] == 0.5 and report["overall"]["flaky/pass_rate"] == 1.0
    with pytest.raises(ValueError, match="suite task:addition counts a correct sample by its own pass@1"):
        make_suite("task:addition").set_correct(["format_ratio>=1"])


def test_a_reward_named_accuracy_is_never_the_correct_metric_by_its_name(tmp_path):
    """TRL users name rewards `accuracy`: a column of that name is no verdict of correctness (no
    pass@k from it), and --correct, which adds an `accuracy`, asks to rename it."""
    path = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    suite = make_suite(f"rewards:{path}", rewards=[{**REWARDS[0], "name": "accuracy"}])
    assert suite.correct_metric() is None
    with pytest.raises(ValueError, match="already reports a metric named 'accuracy', which --correct adds; rename"):
        suite.set_correct(["accuracy>=1"])


def test_training_prompts_left_out_are_said_once_and_counted(tmp_path, caplog):
    from gdpo_ray.eval.suites import held_out_suite
    from gdpo_ray.run.eval_runner import evaluate

    rows = [{"prompt": f"{a}+{a}?", "answer": str(2 * a)} for a in range(4)]
    path = write_jsonl(tmp_path / "h.jsonl", rows)
    with caplog.at_level("WARNING", logger="gdpo_ray.eval.suites"):
        suite = held_out_suite(f"rewards:{path}", [{"prompt": "1+1?"}, {"prompt": "9+9?"}], rewards=REWARDS)
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("eval suite rewards:h: 1 of its 4 items repeat a training prompt and are left out")
    completions = write_jsonl(tmp_path / "c.jsonl", [{"id": str(i), "completions": ["4"]} for i in (0, 2, 3)])
    report = evaluate(suite, completions_file=completions, progress=False)
    assert report["settings"]["training_prompts_left_out"] == 1 and report["counts"]["items"] == 3
