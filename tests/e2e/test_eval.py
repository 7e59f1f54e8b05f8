"""`gdpo-ray eval` end to end on the session's Ray cluster: the demo's policy on a few items of
every suite (hf engine, tiny budgets), generated on a rollout actor and scored."""

import json

import pytest

from gdpo_ray.eval.runner import evaluate
from gdpo_ray.eval.suites import make_suite


@pytest.fixture(scope="module")
def demo_actor(ray_cluster):
    from actors.rollout import RolloutActor
    from gdpo_ray.warm_start import demo_model_dir

    actor = ray_cluster.remote(RolloutActor).options(num_cpus=1).remote(
        model_path=str(demo_model_dir()), rewards=None, group_size=2)
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


@pytest.mark.parametrize("spec", ["task:addition", "task:tool_calls", "task:code", "humaneval", "math",
                                  "bfcl:simple_python", "bfcl:live_irrelevance"])
def test_every_suite_evaluates_the_demo_policy(demo_actor, tmp_path, spec):
    if spec == "math":
        path = tmp_path / "mini.jsonl"
        path.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                                for a in range(3)))
        spec = f"math:{path}"
    if spec.startswith("bfcl"):
        pytest.importorskip("bfcl_eval", reason="pip install --no-deps bfcl-eval==2026.3.23")
    suite = make_suite(spec)
    report = evaluate(suite, actors=[demo_actor], samples=2, max_tokens=8, limit=2, progress=False)
    assert report["counts"] == {"items": 2, "samples": 4}
    assert list(report["overall"]) == list(suite.metrics)
    for item in report["items"].values():
        assert len(item["samples"]) == 2
        for s in item["samples"]:
            assert isinstance(s["completion"], str) and 0 < s["tokens"] <= 8
            assert s["finish_reason"] in ("stop", "length")
            assert all(s[m] in (0.0, 1.0) for m in suite.metrics)  # every sample scored
    assert report["settings"] | {"samples": 2, "max_tokens": 8, "limit": 2} == report["settings"]


def test_the_demo_learns_addition_as_eval_measures_it(demo_actor):
    """Sampling at the demo's temperature, the warm-started policy answers some sums: the
    eval sees what training rewards see (pass@1 > 0, format > 0)."""
    report = evaluate(make_suite("task:addition"), actors=[demo_actor], samples=4, temperature=1.0,
                      top_p=1.0, limit=20, progress=False)
    assert 0 < report["overall"]["pass@1"] < 1 and 0 < report["overall"]["format_ratio"] < 1


def test_the_eval_command_generates_with_rollout_actors(ray_cluster, tmp_path, capsys):
    from gdpo_ray.cli import main

    out = tmp_path / "r.json"
    assert main(["eval", "demo", "--suite", "task:addition", "--limit", "3", "--samples", "2",
                 "--max-tokens", "8", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["policy"] == "demo" and report["counts"] == {"items": 3, "samples": 6}
    assert report["settings"]["engine"] == "hf"
    printed = capsys.readouterr().out
    assert "task:addition" in printed and f"report {out}" in printed
