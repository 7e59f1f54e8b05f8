"""pass@k (Chen et al., 2021): exact values of the estimator with the arithmetic beside them, the
report's per-item, per-category and overall pass@k, ``gdpo-ray eval --pass-k`` on a completions
file, and the bad inputs refused (by the command before Ray starts, by the config's validation)."""

import json
import math
import re
from fractions import Fraction

import pytest

from gdpo_ray.eval.pass_at_k import check_ks, item_pass_at_k, mean_pass_at_k, parse_ks, pass_at_k
from gdpo_ray.eval.report import build_report, compare, format_report
from gdpo_ray.eval.suite import EvalItem, Suite

EXACT = 1e-12  # the product form rounds in the last bits only


def close(value):
    return pytest.approx(value, rel=EXACT, abs=EXACT)


# --- the estimator -------------------------------------------------------------------------


def test_the_papers_example_and_the_edge_cases():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == close(0.7)
    # n=5, c=1, k=2: 1 - C(4,2)/C(5,2) = 1 - 6/10 = 0.4
    assert pass_at_k(5, 1, 2) == close(0.4)
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210 = 5/6
    assert pass_at_k(10, 3, 4) == close(5 / 6)
    # no correct sample: 1 - C(5,k)/C(5,k) = 0 for every k
    assert [pass_at_k(5, 0, k) for k in range(1, 6)] == [0.0] * 5
    # every sample correct: C(0,k) = 0 for k >= 1, so 1 - 0 = 1
    assert [pass_at_k(5, 5, k) for k in range(1, 6)] == [1.0] * 5
    # n-c < k: fewer wrong samples than k, so any k of them hold a correct one: 1
    # n=5, c=3, k=3: n-c = 2 < 3
    assert pass_at_k(5, 3, 3) == 1.0 and pass_at_k(5, 4, 2) == 1.0
    # k = n: 1 - C(n-c, n)/C(n, n) = 1 when c > 0 (n=5, c=1, k=5: 1 - 0/1)
    assert pass_at_k(5, 1, 5) == 1.0


def test_at_k_1_it_is_c_over_n():
    # k=1: 1 - C(n-c,1)/C(n,1) = 1 - (n-c)/n = c/n
    for n in (1, 5, 16):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == close(c / n), (n, c)


def test_the_product_equals_the_ratio_of_binomials_exactly_computed():
    # every (n, c, k) with n <= 20 against 1 - C(n-c,k)/C(n,k) in exact rational arithmetic
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == close(float(exact)), (n, c, k)


def test_large_n_stays_finite_and_exact():
    # C(1000, 500) has 300 digits (no float holds it); the product has 10 factors in [0, 1)
    exact = 1 - Fraction(math.comb(990, 500), math.comb(1000, 500))
    assert pass_at_k(1000, 10, 500) == close(float(exact))
    # n=200, c=1, k=100: 1 - C(199,100)/C(200,100) = 1 - (200-100)/200 = 0.5
    assert pass_at_k(200, 1, 100) == close(0.5)


def test_the_mean_over_items():
    # items (n, c) = (5, 2), (5, 0), (5, 5) at k=2: (0.7 + 0 + 1) / 3 = 1.7 / 3
    assert mean_pass_at_k([(5, 2), (5, 0), (5, 5)], 2) == close(1.7 / 3)
    # different n per item: (4, 1) at k=2 is 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; with (5, 2): (0.5 + 0.7) / 2
    assert mean_pass_at_k([(4, 1), (5, 2)], 2) == close(0.6)
    assert math.isnan(mean_pass_at_k([], 2))


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (0, 0, 1)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(ValueError, match=f"got n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_an_items_samples_are_judged_by_the_correct_metric():
    # 5 samples, one not scored (NaN): n=4, c=2 ("correct" is exactly 1; 0.5 is not)
    samples = [{"pass@1": v} for v in (1.0, 0.0, math.nan, 1.0, 0.5)]
    got = item_pass_at_k(samples, "pass@1", [1, 2, 4, 5])
    # k=1: 2/4; k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6; k=4: n-c = 2 < 4 -> 1; k=5 > n=4: no value
    assert got["pass@1"] == close(0.5) and got["pass@2"] == close(5 / 6) and got["pass@4"] == 1.0
    assert math.isnan(got["pass@5"])


# --- parsing and checking the ks -----------------------------------------------------------


def test_ks_are_parsed_sorted_and_once():
    assert parse_ks("16,1, 4,4", "--pass-k") == (1, 4, 16)
    assert parse_ks([4, 1], "training.eval_pass_k") == (1, 4)


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "a", "", "1,,4", "4.0", [0], [1.0], [True], ["4"], [], {}])
def test_bad_ks_are_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=r"--pass-k must be (a list of )?integers >= 1"):
        parse_ks(value, "--pass-k")


def test_a_k_over_n_names_both_settings_and_the_fix():
    check_ks((1, 4), 4, "--pass-k", "--samples")
    with pytest.raises(ValueError, match=r"--pass-k asks for pass@8 but --samples is 4: .* raise --samples "
                                         r"to 16 or leave k <= 4 in --pass-k"):
        check_ks((1, 8, 16), 4, "--pass-k", "--samples")


# --- the report ----------------------------------------------------------------------------


class Toy(Suite):
    """Completions are their own scores ("1" passes)."""

    name, metrics = "toy", ("pass@1", "exceed_ratio")

    def all_items(self):
        return [EvalItem(i, "p", "x", None) for i in "abc"]

    def score(self, item, completions):
        return [{"pass@1": float(c.text == "1"), "exceed_ratio": 0.0} for c in completions]


class ToyAccuracy(Toy):
    name, metrics = "toy_acc", ("accuracy", "format_ratio")


class NoCorrect(Toy):
    name, metrics = "toy_len", ("exceed_ratio",)


def samples(*passes, metric="pass@1", other="exceed_ratio"):
    return [{metric: float(p), other: 0.0} for p in passes]


def test_the_report_gets_pass_at_k_per_item_category_and_overall():
    # a: 4 samples, 2 right; b: 4 samples, 0 right (category x); c: 4 samples, 1 right (category y)
    scored = {"a": samples(1, 0, 1, 0), "b": samples(0, 0, 0, 0), "c": samples(0, 0, 0, 1)}
    report = build_report(Toy(), scored, {"a": "x", "b": "x", "c": "y"}, "p", {}, pass_k=(1, 2, 4))
    # a: pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; pass@4: n-c = 2 < 4 -> 1
    # c: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1 - C(3,4)/C(4,4) = 1 - 0 = 1
    assert report["items"]["a"]["pass@2"] == close(5 / 6) and report["items"]["a"]["pass@4"] == 1.0
    assert report["items"]["b"]["pass@2"] == 0.0 and report["items"]["b"]["pass@4"] == 0.0
    assert report["items"]["c"]["pass@2"] == close(0.5) and report["items"]["c"]["pass@4"] == 1.0
    # category x: the mean of a and b: pass@2 (5/6 + 0) / 2 = 5/12, pass@4 (1 + 0) / 2
    assert report["categories"]["x"]["pass@2"] == close(5 / 12) and report["categories"]["x"]["pass@4"] == 0.5
    assert report["categories"]["y"]["pass@2"] == close(0.5)
    # overall: the mean over items: pass@2 (5/6 + 0 + 1/2) / 3 = 4/9, pass@4 (1 + 0 + 1) / 3 = 2/3
    assert list(report["overall"]) == ["pass@1", "exceed_ratio", "pass@2", "pass@4"]
    assert report["overall"]["pass@2"] == close(4 / 9) and report["overall"]["pass@4"] == close(2 / 3)
    # pass@1 stays the avg@n mean, (2/4 + 0 + 1/4) / 3 = 1/4, which is the estimator at k=1
    assert report["overall"]["pass@1"] == close(0.25)
    assert report["overall"]["pass@1"] == close(mean_pass_at_k([(4, 2), (4, 0), (4, 1)], 1))
    # the table and --compare show the new columns
    assert format_report(report).splitlines()[0].split() == ["toy", "pass@1", "exceed_ratio", "pass@2",
                                                             "pass@4", "items"]
    table = compare({"run": [report]}).splitlines()  # a row per metric, a column per run
    assert table[0].split() == ["toy", "run"]
    assert [line.split() for line in table[2:6]] == [["pass@1", "0.250"], ["pass@2", "0.444"], ["pass@4", "0.667"],
                                                     ["exceed_ratio", "0.000"]]


def test_pass_at_1_equals_the_estimator_at_k_1_on_every_item():
    # n=5 per item, c = 0..5: the avg@n mean of pass@1 is c/5, and so is the estimator at k=1
    scored = {str(c): samples(*([1] * c + [0] * (5 - c))) for c in range(6)}
    report = build_report(Toy(), scored, {k: "x" for k in scored}, "p", {}, pass_k=(1,))
    for c in range(6):
        assert report["items"][str(c)]["pass@1"] == close(pass_at_k(5, c, 1)) == close(c / 5)


def test_a_suite_without_pass_at_1_counts_its_accuracy():
    # accuracy 1, 1, 0 (n=3, c=2): pass@1 = 2/3 = accuracy's avg@n; pass@2 = 1 - C(1,2)/C(3,2) = 1
    scored = {"a": samples(1, 1, 0, metric="accuracy", other="format_ratio")}
    report = build_report(ToyAccuracy(), scored, {"a": "x"}, "p", {}, pass_k=(1, 2))
    assert report["overall"]["pass@1"] == close(report["overall"]["accuracy"]) == close(2 / 3)
    assert report["overall"]["pass@2"] == 1.0
    with pytest.raises(ValueError, match="reports neither pass@1 nor accuracy"):
        build_report(NoCorrect(), {"a": [{"exceed_ratio": 0.0}]}, {"a": "x"}, "p", {}, pass_k=(1,))


def test_bfcl_groups_pass_at_k_as_it_groups_accuracy():
    pytest.importorskip("bfcl_eval", reason="pip install --no-deps bfcl-eval==2026.3.23")
    from gdpo_ray.eval.suites import make_suite

    suite = make_suite("bfcl")
    # two samples per item: both right on even items, one right on odd ones
    scored = {it.id: samples(1, i % 2 == 0, metric="accuracy", other="format_ratio")
              for i, it in enumerate(suite.items())}
    report = build_report(suite, scored, {it.id: it.category for it in suite.items()}, "p", {}, pass_k=(1, 2))
    # k=1: the estimator is each item's accuracy (c/n), grouped as accuracy is: equal
    assert report["overall"]["pass@1"] == close(report["overall"]["accuracy"])
    # k=2: every item has a right sample among its two (1 on each): every group 1, their mean 1
    assert report["overall"]["pass@2"] == close(1.0)
    assert all(c["pass@2"] == 1.0 for c in report["categories"].values())


# --- gdpo-ray eval --pass-k ----------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def addition_completions(tmp_path, rights):
    """A completions file of task:addition: item i has 4 completions, ``rights[i]`` of them right."""
    from gdpo_ray.eval.suites import make_suite

    items = make_suite("task:addition").items()[:len(rights)]
    rows = [{"id": it.id, "completions": [f"<think>x</think><answer>{it.reference}</answer>"] * c + ["?"] * (4 - c),
             "tokens": [6] * 4} for it, c in zip(items, rights)]
    return write_jsonl(tmp_path / "c.jsonl", rows)


def test_the_eval_command_reports_pass_at_k(tmp_path, capsys):
    from gdpo_ray.run.cli import main

    path = addition_completions(tmp_path, [2, 0, 4])  # 3 items, 4 samples each
    out = tmp_path / "r.json"
    assert main(["eval", "--suite", "task:addition", "--completions", path, "--pass-k", "1,2,4",
                 "--output", str(out), "--json"]) == 0
    printed = capsys.readouterr().out
    overall = json.loads([line for line in printed.splitlines() if line.startswith("{")][0])
    # pass@1: (2/4 + 0 + 4/4) / 3 = 0.5 (the avg@n mean)
    # pass@2: item 1: 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; item 2: 0; item 3: 1 -> (5/6 + 0 + 1) / 3 = 11/18
    # pass@4: item 1: n-c = 2 < 4 -> 1; item 2: 0; item 3: 1 -> 2/3
    assert overall["pass@1"] == close(0.5)
    assert overall["pass@2"] == close(11 / 18) and overall["pass@4"] == close(2 / 3)
    report = json.loads(out.read_text())
    assert report["overall"] == overall and report["settings"]["pass_k"] == [1, 2, 4]
    assert report["categories"]["addition"]["pass@2"] == close(11 / 18)
    header = printed.splitlines()[0].split()
    assert header == ["task:addition", "pass@1", "format_ratio", "exceed_ratio", "pass@2", "pass@4", "items"]
    assert main(["eval", "--compare", str(out)]) == 0
    compared = capsys.readouterr().out.splitlines()
    assert compared[0].split()[0] == "task:addition"
    assert [line.split()[1] for line in compared if line.startswith("pass@4")] == ["0.667"]


@pytest.mark.parametrize("flag, message", [
    ("0", "--pass-k must be integers >= 1"), ("1.5", "--pass-k must be integers >= 1"),
    ("a,2", "--pass-k must be integers >= 1"),
    ("2,8", r"--pass-k asks for pass@8 but the number of completions of item \S+ in \S+ is 4"),
])
def test_bad_pass_k_on_a_completions_file_exits_2(tmp_path, capsys, flag, message):
    from gdpo_ray.run.cli import main

    path = addition_completions(tmp_path, [1, 1])
    assert main(["eval", "--suite", "task:addition", "--completions", path, "--pass-k", flag]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_k_over_samples_fails_before_ray_or_the_policy(monkeypatch, capsys):
    from gdpo_ray.run import cluster, eval_runner
    from gdpo_ray.run.cli import main

    def never(*args, **kwargs):
        raise AssertionError("reached before --pass-k was checked")

    monkeypatch.setattr(eval_runner, "resolve_policy", never)
    monkeypatch.setattr(cluster, "start_ray", never)
    assert main(["eval", "demo", "--suite", "task:addition", "--samples", "4", "--pass-k", "1,16"]) == 2
    err = capsys.readouterr().err
    assert "--pass-k asks for pass@16 but --samples is 4" in err and "raise --samples to 16" in err


# --- training.eval_pass_k ------------------------------------------------------------------


def config(**training):
    from gdpo_ray import GDPOConfig

    return (GDPOConfig().llm(model_path="demo").data(prompts="task:addition")
            .training(rewards=[{"name": "correct", "fn": "math_correctness"}], group_size=4, prompts_per_step=2,
                      eval_every=1, eval_suite="task:addition", **training))


def test_training_eval_pass_k_is_validated():
    config(eval_samples=4, eval_pass_k=[1, 4]).validate()
    config(eval_pass_k=None).validate()
    with pytest.raises(ValueError, match="training.eval_pass_k asks for pass@8 but training.eval_samples is 4"):
        config(eval_samples=4, eval_pass_k=[1, 8]).validate()
    for bad in ([0], [2.0], ["4"]):
        with pytest.raises(ValueError, match="training.eval_pass_k must be integers >= 1"):
            config(eval_samples=4, eval_pass_k=bad).validate()
    with pytest.raises(ValueError, match="training.eval_pass_k must be a list or null"):
        config(eval_samples=4, eval_pass_k="1,4").validate()
