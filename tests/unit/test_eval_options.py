"""`gdpo-ray eval`'s options are checked before anything is read or started, whether or not this
evaluation uses them (issue 50: `--max-tokens -5`, `--temperature nan`, `--length-limit -1` were
accepted beside `--completions`): each error names the option, the value and the range."""

import pytest

from gdpo_ray.run import cluster
from gdpo_ray.run.cli import main


@pytest.fixture
def nothing_read(monkeypatch, tmp_path):
    """A scratch folder; building a suite or starting Ray fails the test."""
    import gdpo_ray.eval.suites as suites

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suites, "make_suite", lambda *a, **k: pytest.fail("the suite was loaded"))
    monkeypatch.setattr(cluster, "start_ray", lambda *a, **k: pytest.fail("Ray was started"))
    return tmp_path


@pytest.mark.parametrize("option, value, said", [
    ("--max-tokens", "-5", "--max-tokens must be an integer >= 1 (new tokens per completion); got -5"),
    ("--temperature", "nan", "--temperature must be a finite number > 0 (logits / temperature); got nan"),
    ("--temperature", "inf", "--temperature must be a finite number > 0 (logits / temperature); got inf"),
    ("--temperature", "0", "--temperature must be a finite number > 0 (logits / temperature); got 0.0"),
    ("--length-limit", "-1", "--length-limit must be an integer >= 1 (exceed_ratio's limit in tokens); got -1"),
    ("--top-p", "1.5", "--top-p must be a finite number > 0 and <= 1 (the nucleus' probability mass); got 1.5"),
    ("--top-p", "0", "--top-p must be a finite number > 0 and <= 1 (the nucleus' probability mass); got 0.0"),
    ("--samples", "0", "--samples must be an integer >= 1 (completions per item); got 0"),
    ("--limit", "0", "--limit must be an integer >= 1 (the suite's first N items); got 0"),
    ("--max-prompt-tokens", "0", "--max-prompt-tokens must be an integer >= 1 (the longest prompt generated); got 0"),
    ("--num-actors", "0", "--num-actors must be an integer >= 1 (rollout actors); got 0"),
    ("--num-cpus", "-2", "--num-cpus must be an integer >= 1 (CPUs of the local Ray); got -2"),
    ("--pass-k", "1,0", "--pass-k must be integers >= 1 (the k of pass@k), e.g. 1,4,16; got '0'"),
    ("--engine-kwargs", "[1]", "--engine-kwargs must be a JSON object of the engine's arguments"),
    ("--engine-kwargs", "{dtype", "--engine-kwargs is not JSON"),
])
@pytest.mark.parametrize("scoring", ["--completions", "policy", "--compare"])
def test_every_option_is_checked_whether_or_not_it_is_used(nothing_read, capsys, option, value, said, scoring):
    given = {"--completions": ["--suite", "task:addition", "--completions", "missing.jsonl"],
             "policy": ["demo", "--suite", "task:addition"], "--compare": ["--compare", "runs/a"]}[scoring]
    assert main(["eval", *given, option, value]) == 2
    assert f"gdpo-ray eval: {said}" in capsys.readouterr().err
    assert list(nothing_read.iterdir()) == []


def test_pass_k_over_the_samples_generated_is_refused_before_the_suite_loads(nothing_read, capsys):
    assert main(["eval", "demo", "--suite", "task:addition", "--samples", "2", "--pass-k", "1,4"]) == 2
    assert ("gdpo-ray eval: --pass-k asks for pass@4 but --samples is 2: pass@k needs at least k samples per "
            "item; raise --samples to 4 or leave k <= 2 in --pass-k") in capsys.readouterr().err


def test_options_in_range_go_on_to_the_suite(nothing_read):
    with pytest.raises(pytest.fail.Exception, match="the suite was loaded"):
        main(["eval", "--suite", "task:addition", "--completions", "missing.jsonl", "--max-tokens", "8",
              "--temperature", "1e-3", "--top-p", "1", "--length-limit", "4", "--pass-k", "1,8",
              "--engine-kwargs", '{"dtype": "float32"}'])
