"""The worked examples of docs/architecture.md (docs/examples/*.py), run as the page shows them,
so the page cannot rot: a reward, an estimator and an eval suite of one's own. The engine and the
weight transport run in tests/e2e/test_architecture.py (they need Ray)."""

import json

import numpy as np
import pytest

from gdpo_ray.advantages import compute_advantage_details, compute_advantages
from gdpo_ray.rewards import RewardSpec, call_reward, check_specs


def test_a_reward_of_ones_own_by_import_path():
    spec = RewardSpec.from_dict({"name": "brief", "fn": "docs.examples.brevity_reward:brevity",
                                 "params": {"limit": 4}})
    check_specs([spec])
    fn = spec.resolve()
    completions = ["one two", "one two three four five six", "a b c d e f g h i", [{"role": "assistant", "content": "hi"}]]
    # 2 words: 1; 6 words: 2 - 6/4 = 0.5; 9 words: max(0, 2 - 9/4) = 0; chat "hi": 1
    assert call_reward(fn, prompts=["p"] * 4, completions=completions, completion_ids=[[1]] * 4) == [1.0, 0.5, 0.0, 1.0]


def test_an_estimator_of_ones_own(example_registrations):
    import docs.examples.no_batch_norm_estimator  # noqa: F401 - registers "gdpo_no_batch_norm"

    rewards = np.array([[1, 1], [0, 1], [0, 0], [0, 0]], float)
    # r1 = (1,0,0,0): mean 0.25, std (ddof 1) 0.5 -> (1.5, -0.5, -0.5, -0.5)
    # r2 = (1,1,0,0): mean 0.5, std sqrt(1/3) -> (+-0.8660254): summed (2.3660254, 0.3660254, -1.3660254 x2)
    got = compute_advantages(rewards, [0, 0, 0, 0], estimator="gdpo_no_batch_norm", eps=0)
    np.testing.assert_allclose(got, [2.3660254, 0.3660254, -1.3660254, -1.3660254], atol=1e-7)
    gdpo = compute_advantage_details(rewards, [0, 0, 0, 0], estimator="gdpo", eps=0)
    np.testing.assert_array_equal(got, gdpo.summed)  # GDPO before its batch normalization
    from gdpo_ray import GDPOConfig

    config = GDPOConfig().llm(model_path="tiny").data(prompts="task:addition").training(
        estimator="gdpo_no_batch_norm", rewards=[{"name": "brief", "fn": "length", "params": {"limit": 8}}])
    config.validate()  # the name is accepted where the config is checked


def test_an_eval_suite_of_ones_own(tmp_path, example_registrations):
    import docs.examples.repeat_suite  # noqa: F401 - registers the family "repeat"
    from gdpo_ray.eval.suites import make_suite
    from gdpo_ray.run.eval_runner import evaluate

    suite = make_suite("repeat:2")
    assert [it.reference for it in suite.items()] == ["apple", "river"]
    path = tmp_path / "completions.jsonl"
    path.write_text(json.dumps({"id": "repeat_0", "completions": ["apple", "Apple.", "pear", "apple"]}) + "\n"
                    + json.dumps({"id": "repeat_1", "completions": ["stone", "river", "x", "y"]}) + "\n")
    report = evaluate(suite, completions_file=str(path), progress=False)
    # avg@4: item 0 passes 3 of 4 (0.75), item 1 1 of 4 (0.25); mean over items 0.5
    assert report["overall"] == {"pass@1": 0.5}
    with pytest.raises(ValueError, match=r"repeat:<n> takes 1 <= n <= 8; got 9"):
        make_suite("repeat:9")


class HalfEngine:
    """An engine half written: the architecture page quotes the error it gets."""

    weight_transfer = False

    @classmethod
    def check_sampling(cls, sampling):
        pass

    def generate(self, prompt_token_ids, n, sampling, logprobs=True):
        return []

    def shutdown(self):
        pass


def test_the_engine_error_the_page_quotes_is_the_real_one():
    from pathlib import Path

    from actors.engines import engine_class

    with pytest.raises(ValueError) as err:
        engine_class("tests.unit.test_architecture:HalfEngine", "batched")
    page = " ".join((Path(__file__).parents[2] / "docs/architecture.md").read_text().split())
    assert " ".join(str(err.value).split()) in page
