"""Judges as rewards: a rubric's columns, the judge's prompt, the verdict's parsing, the endpoint
client against a real HTTP server (retries, timeouts, keys) and a rollout actor's judging."""

import math

import numpy as np
import pytest

from gdpo_ray.judges.endpoint import EndpointJudge, JudgeUnavailable
from gdpo_ray.judges.rubric import JudgeSetting, expand_judges, rubric_of
from gdpo_ray.judges.verdict import DEFAULT_PROMPT, columns_asked, parse_verdict, render
from gdpo_ray.rewards import check_specs, reward_specs
from tests.judge_server import JudgeServer, expected_score

CRITERIA = [{"name": "helpful", "describe": "answers the question asked", "scale": [0, 1]},
            {"name": "concise", "describe": "no needless words", "scale": [0, 1], "weight": 0.5},
            {"name": "grounded", "describe": "uses the reference", "scale": [0, 10],
             "condition": {"on": "format", "min": 1}}]


def entry(url="http://127.0.0.1:9/v1", **extra):
    return {"name": "quality", "fn": "judge", "judge": {"url": url, "model": "m", **extra.pop("judge", {})},
            "criteria": CRITERIA, **extra}


# -- the rubric's columns ---------------------------------------------------------------------

def test_each_criterion_is_a_column_with_its_own_weight_and_condition():
    specs = reward_specs([{"name": "format", "fn": "regex", "params": {"pattern": "x"}}, entry(weight=2.0)])
    assert [s.name for s in specs] == ["format", "quality/helpful", "quality/concise", "quality/grounded"]
    assert [s.weight for s in specs] == [1.0, 2.0, 0.5, 2.0]  # a criterion's weight, else the entry's
    assert specs[3].condition.on == "format" and specs[3].condition.min == 1
    assert specs[1].condition is None and specs[3].params["scale"] == [0.0, 10.0]
    fns = check_specs(specs)
    assert fns[1:] == [None, None, None]  # judged, not called
    rubric = rubric_of(specs[2].params)
    assert rubric.columns == ["quality/helpful", "quality/concise", "quality/grounded"]
    assert rubric.judge == JudgeSetting(model="m", url="http://127.0.0.1:9/v1")


def test_expanding_twice_changes_nothing_and_keeps_plain_data():
    import json

    once = expand_judges([entry()])
    assert expand_judges(once) == once
    assert json.loads(json.dumps(once)) == once  # JSON-able: Tune, the run's config file


@pytest.mark.parametrize("change, words", [
    ({"judge": {"api_key": "sk-1"}}, "never write a key"),
    ({"judge": {"url": "127.0.0.1:8000"}}, "http(s) URL"),
    ({"judge": {"api_key_env": "my-key"}}, "names an environment variable"),
    ({"judge": {"timeout": 3}}, "did you mean 'timeout_s'"),
    ({"judge": {"retries": -1}}, "judge.retries must be an integer"),
    ({"criteria": []}, "non-empty list"),
    ({"criteria": [{"name": "a/b"}]}, "letters, digits"),
    ({"criteria": [{"name": "a"}, {"name": "a"}]}, "repeated: ['a']"),
    ({"criteria": [{"name": "a", "scale": [1, 1]}]}, "low < high"),
    ({"criteria": [{"name": "a", "scael": [0, 1]}]}, "did you mean 'scale'"),
    ({"prompt": "judge {prompt}"}, "holding {completion}"),
    ({"criterion": []}, "did you mean 'criteria'"),
    ({"judge": {"modle": "m"}}, "did you mean 'model'"),
    ({"prompt": "Score it: {completion}"}, "never names the criteria ['helpful', 'concise', 'grounded']"),
    ({"name": "a/b"}, "without '/'"),
])
def test_a_wrong_judge_entry_names_what_and_how(change, words):
    e = entry()
    for key, value in change.items():
        e[key] = {**e[key], **value} if key == "judge" else value
    with pytest.raises(ValueError, match=None) as info:
        reward_specs([e])
    assert words in str(info.value)


def test_a_column_cannot_take_a_floor_or_timeout():
    column = expand_judges([entry()])[0]
    with pytest.raises(ValueError, match="takes no floor or timeout_s"):
        check_specs(reward_specs([{**column, "timeout_s": 5}]))


# -- the prompt -------------------------------------------------------------------------------

def test_the_default_prompt_holds_criteria_conversation_response_and_format():
    rubric = rubric_of(expand_judges([entry()])[0]["params"])
    text = render(None, rubric.criteria, [{"role": "user", "content": "2+2?"}],
                  [{"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
                   {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}], {})
    assert "- helpful (0 to 1): answers the question asked\n- concise (0 to 1): no needless words" in text
    assert "- grounded (0 to 10): uses the reference" in text
    assert "[user]\n2+2?" in text
    assert '[assistant]\ncall: add {"a": 2, "b": 2}\n[tool]\n4\n[assistant]\nIt is 4.' in text
    assert text.endswith('{"helpful": <0 to 1>, "concise": <0 to 1>, "grounded": <0 to 10>}')
    assert DEFAULT_PROMPT.startswith(text[:20])


def test_a_template_takes_row_columns_and_leaves_other_braces():
    template = 'Ref: {ground_truth}\n{completion}\nScore helpful, concise, grounded like {"x": 1}'
    rubric = rubric_of(expand_judges([entry(prompt=template)])[0]["params"])
    assert columns_asked(rubric.prompt) == ["ground_truth"]
    assert render(rubric.prompt, rubric.criteria, "q", "a", {"ground_truth": 4}) == (
        'Ref: 4\na\nScore helpful, concise, grounded like {"x": 1}')
    with pytest.raises(KeyError, match="names {ground_truth}, which is not a column"):
        render(rubric.prompt, rubric.criteria, "q", "a", {"answer": 4})


# -- the verdict ------------------------------------------------------------------------------

def criteria():
    return rubric_of(expand_judges([entry()])[0]["params"]).criteria


@pytest.mark.parametrize("text, expected", [
    ('{"helpful": 1, "concise": 0.5, "grounded": 7}', [1.0, 0.5, 7.0]),
    ('Sure.\n```json\n{"Helpful ": "1", "concise": false, "grounded": {"score": 3, "why": "ok"}}\n```', [1.0, 0.0, 3.0]),
    ('{"note": "first"} then {"helpful": 0, "concise": 1, "grounded": 10}', [0.0, 1.0, 10.0]),
    ("<helpful>1</helpful> <CONCISE> 0 </CONCISE> <grounded>2.5</grounded>", [1.0, 0.0, 2.5]),
])
def test_a_verdict_is_read_from_json_or_tags(text, expected):
    assert [v for v, _ in parse_verdict(text, criteria())] == expected
    assert all(why == "" for _, why in parse_verdict(text, criteria()))


def test_a_bad_verdict_is_nan_with_its_reason_never_zero():
    out = parse_verdict('{"helpful": 3, "grounded": "high"}', criteria())
    assert all(math.isnan(v) for v, _ in out)
    assert out[0][1] == "judge scored 'helpful' 3, outside its scale [0, 1]"
    assert out[1][1] == "judge verdict has no score for 'concise' (its JSON named ['grounded', 'helpful'])"
    assert out[2][1] == "judge scored 'grounded' 'high': not a number"
    unparsable = parse_verdict("I like it a lot!", criteria())
    assert all(math.isnan(v) for v, _ in unparsable)
    assert unparsable[0][1].startswith("judge verdict unparsable: no JSON object naming a criterion")
    assert "'I like it a lot!'" in unparsable[0][1]
    assert math.isnan(parse_verdict('{"helpful": NaN, "concise": 1, "grounded": 1}', criteria())[0][0])


# -- the endpoint -----------------------------------------------------------------------------

def ask(setting, message):
    import asyncio

    async def go():
        judge = EndpointJudge(setting)
        try:
            return await judge.ask(message), judge.retried
        finally:
            await judge.close()

    return asyncio.run(go())


def message(response):
    return render(None, criteria(), "q", response, {})


def test_the_endpoint_answers_with_the_key_as_a_bearer_token(monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-secret-123")
    with JudgeServer(key="sk-secret-123") as server:
        setting = JudgeSetting(model="judge-m", url=server.url, api_key_env="TEST_JUDGE_KEY", max_tokens=64)
        answer, retried = ask(setting, message("hello"))
        assert [v for v, _ in parse_verdict(answer.text, criteria())] == [
            expected_score(c, "hello") for c in ("helpful", "concise", "grounded")]
        assert retried == 0 and answer.tokens > 10 and answer.latency_s > 0
        assert server.bodies[0]["model"] == "judge-m" and server.bodies[0]["max_tokens"] == 64
        assert server.bodies[0]["temperature"] == 0.0
        assert server.headers[0]["Authorization"] == "Bearer sk-secret-123"


def test_a_wrong_key_is_not_retried_and_the_key_never_shows(monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-wrong-456")
    with JudgeServer(key="sk-right") as server:
        setting = JudgeSetting(model="m", url=server.url, api_key_env="TEST_JUDGE_KEY", retries=3)
        with pytest.raises(JudgeUnavailable) as info:
            ask(setting, message("hello"))
        assert server.requests == 1 and info.value.kind == "infra"
        assert "HTTP 401" in str(info.value) and "sk-wrong-456" not in str(info.value)
    monkeypatch.delenv("TEST_JUDGE_KEY")
    with pytest.raises(JudgeUnavailable, match="environment variable TEST_JUDGE_KEY is not set"):
        ask(JudgeSetting(model="m", url="http://127.0.0.1:9/v1", api_key_env="TEST_JUDGE_KEY"), "x")


def test_a_5xx_is_retried_and_then_answered(monkeypatch):
    import gdpo_ray.judges.endpoint as endpoint

    monkeypatch.setattr(endpoint, "BACKOFF_S", 0.01)
    with JudgeServer() as server:
        answer, retried = ask(JudgeSetting(model="m", url=server.url), message("FLAKY one"))
        assert retried == 1 and server.requests == 2
        assert not math.isnan(parse_verdict(answer.text, criteria())[0][0])


def test_a_timeout_and_a_dead_server_fail_after_their_retries(monkeypatch):
    import gdpo_ray.judges.endpoint as endpoint

    monkeypatch.setattr(endpoint, "BACKOFF_S", 0.01)
    with JudgeServer(slow_s=5) as server:
        with pytest.raises(JudgeUnavailable) as info:
            ask(JudgeSetting(model="m", url=server.url, timeout_s=0.3, retries=1), message("SLOW one"))
        assert info.value.kind == "timeout" and server.requests == 2
        assert "no answer within 0.3 s (2 attempts)" in str(info.value)
    with pytest.raises(JudgeUnavailable) as info:  # nothing listens there any more
        ask(JudgeSetting(model="m", url=server.url, retries=2), "x")
    assert info.value.kind == "infra" and "could not be reached" in str(info.value) and "(3 attempts)" in str(info.value)


# -- a rollout actor's judging ----------------------------------------------------------------

def test_judging_gives_each_criterion_its_column_once_per_distinct_message(monkeypatch):
    import gdpo_ray.judges.endpoint as endpoint
    from actors.judging import Judging, JudgeStats

    monkeypatch.setattr(endpoint, "BACKOFF_S", 0.01)
    with JudgeServer(slow_s=5) as server:
        specs = reward_specs([entry(url=server.url, judge={"timeout_s": 0.5, "retries": 1})])
        judging = Judging(specs)
        try:
            responses = ["four", "four", "It is 4", "MALFORMED", "OUTOFSCALE", "SLOW", "NOSCORE x"]
            rows = [{"ground_truth": "4"}] * len(responses)
            columns = judging.collector(judging.submit(["q"] * len(responses), responses, rows), len(responses))()
            stats = judging.take_stats()
        finally:
            judging.close()
    assert set(columns) == {"quality/helpful", "quality/concise", "quality/grounded"}
    for name in ("helpful", "concise", "grounded"):
        values, kinds, errors = columns[f"quality/{name}"]
        assert values[:3] == [expected_score(name, r) for r in responses[:3]] and kinds[:3] == [""] * 3
        assert math.isnan(values[3]) and kinds[3] == "error" and "unparsable" in errors[3]
        assert math.isnan(values[5]) and kinds[5] == "timeout" and "no answer within 0.5 s" in errors[5]
    helpful = columns["quality/helpful"]
    assert math.isnan(helpful[0][4]) and "outside its scale [0, 1]" in helpful[2][4]
    assert columns["quality/grounded"][0][4] == 7.0  # within [0, 10]
    assert math.isnan(helpful[0][6]) and "no score for 'helpful'" in helpful[2][6]
    assert columns["quality/concise"][0][6] == expected_score("concise", "NOSCORE x")
    assert stats["calls"] == 6 and stats["cached"] == 1  # "four" twice: judged once
    assert stats["retries"] == 1  # the slow one, asked twice
    assert math.isnan(columns["quality/concise"][0][4])
    assert stats["failures"] == 3 + 2 + 3 + 1  # malformed, out of scale (helpful, concise), timeout, no score
    metrics = JudgeStats()
    metrics.add(stats)
    out = metrics.take()
    assert out["judge/calls"] == 6 and out["judge/latency_p95_s"] >= out["judge/latency_s"] > 0
    later = metrics.take()  # a step with nothing judged, in a run with judges: zeros, no latency
    assert later["judge/calls"] == 0 and math.isnan(later["judge/latency_s"])
    assert JudgeStats().take() == {}  # a run without judges has no judge/*


def test_the_reward_pool_takes_judged_columns_and_applies_their_conditions():
    from actors.reward import RewardPool

    specs = [{"name": "format", "fn": "regex", "params": {"pattern": r"\d"}}, entry()]
    judged = {"quality/helpful": ([1.0, 0.0], ["", ""], ["", ""]),
              "quality/concise": ([math.nan, 1.0], ["error", ""], ["judge verdict unparsable: ...", ""]),
              "quality/grounded": ([5.0, 6.0], ["", ""], ["", ""])}
    with RewardPool(specs) as pool:
        assert pool.judge_columns == ["quality/helpful", "quality/concise", "quality/grounded"]
        result = pool.score(["q", "q"], ["4", "four"], judged=lambda: judged)
    np.testing.assert_array_equal(result.values[:, [0, 1, 3]], [[1, 1, 5], [0, 0, 0]])  # grounded gated by format
    assert math.isnan(result.values[0, 2]) and result.errors[0][2] == "error: judge verdict unparsable: ..."
    assert result.metrics["rewards/quality/concise/failure_rate"] == 0.5
    with RewardPool(specs) as pool:  # no judge asked: every judged row says so, none is 0
        result = pool.score(["q"], ["4"])
    assert np.isnan(result.values[0, 1:]).all() and "no judge was asked" in result.errors[0][1]


def test_the_judges_page_shows_the_default_prompt_as_it_is():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "judges.md").read_text()
    assert f"```text\n{DEFAULT_PROMPT}\n```" in page


def test_scores_decoding_is_the_expected_score_under_the_judges_next_token_probabilities(tiny_model_dir):
    """judges.judge_decoding: scores: each criterion's score is the mean of its scale's integers
    under the probabilities of their tokens after '{"<name>":', as one plain forward pass gives them
    (the actor reads them through a cache of the message)."""
    import json

    import torch

    from actors.judge_pool import JudgeActor

    actor = JudgeActor(tiny_model_dir, decoding="scores")
    criteria = [("helpful", 0, 1), ("grounded", 1, 5)]
    messages = [message("It is 4."), message("MALFORMED")]
    answers = actor.judge(messages, 8, 0.0, criteria)
    for m, (text, tokens, error) in zip(messages, answers):
        assert error == "" and tokens == len(actor._tokens(m))
        verdict = json.loads(text)
        for name, low, high in criteria:
            ids = actor._tokens(m) + actor.tokenizer(f'{{"{name}":', add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = actor.engine.model(torch.tensor([ids])).logits[0, -1].double()
            values = list(range(low, high + 1))
            p = torch.softmax(logits[[actor._score_token(v) for v in values]], dim=0)
            assert verdict[name] == pytest.approx(float((p * torch.tensor(values, dtype=torch.float64)).sum()), abs=2e-6)
            assert low <= verdict[name] <= high
    assert "an integer scale" in actor.judge(messages[:1], 8, 0.0, [("helpful", 0, 0.5)])[0][2]


def test_a_criterions_condition_written_in_yaml_reads_as_any_condition():
    """YAML 1.1 reads an unquoted `on:` as True; a criterion's condition is mended as a reward's."""
    import yaml

    from gdpo_ray import GDPOConfig

    rewards = yaml.safe_load("""
- {name: format, fn: regex, params: {pattern: 'x'}}
- name: quality
  fn: judge
  judge: {url: "http://127.0.0.1:9/v1", model: m}
  criteria:
    - {name: helpful, condition: {on: format, min: 1}}
""")
    assert True in rewards[1]["criteria"][0]["condition"]
    config = GDPOConfig().training(rewards=rewards)
    specs = reward_specs(config.rewards)
    assert specs[1].condition.on == "format" and specs[1].condition.min == 1


def test_the_start_up_check_asks_each_endpoint_for_its_models(monkeypatch):
    from types import SimpleNamespace

    from gdpo_ray.run.judges import probe_endpoints

    def config(url, **judge):
        return SimpleNamespace(rewards=[entry(url=url, judge=judge)])

    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-1")
    with JudgeServer(key="sk-1") as server:
        assert probe_endpoints(config(server.url, api_key_env="TEST_JUDGE_KEY")) == []
        monkeypatch.setenv("TEST_JUDGE_KEY", "sk-2")
        refused = probe_endpoints(config(server.url, api_key_env="TEST_JUDGE_KEY"))
        assert len(refused) == 1 and "refused the key in TEST_JUDGE_KEY (HTTP 401" in refused[0]
    dead = probe_endpoints(config(server.url))  # nothing listens there any more
    assert len(dead) == 1 and f"the judge at {server.url} cannot be reached" in dead[0]
