"""The counting model's warm start (``demo-count``): its teacher's slips and rates, the token
lengths the study's limit is set from, and the cache."""

import numpy as np
import pytest

from gdpo_ray.models import demo_count
from gdpo_ray.models.demo_count import RECIPE, TAGS, slip, teacher_response
from gdpo_ray.rewards import get

exact = get("exact_answer")
SMALL = dict(hidden_size=32, clean_steps=2, steps=1, batch_size=2)


def test_each_slip_is_one_mistake_the_model_can_represent():
    seen = set()
    rng = np.random.default_rng(0)
    for _ in range(200):
        slipped = slip([23, 24, 25, 26], rng)
        seen.add(tuple(slipped))
    # a number short, one past the end, or one left out inside (never the first or the last)
    assert seen == {(23, 24, 25), (23, 24, 25, 26, 27), (23, 25, 26), (23, 24, 26)}
    assert {tuple(slip([40, 41], np.random.default_rng(s))) for s in range(50)} == {(40,), (40, 41, 42)}


def test_the_teacher_is_right_at_its_rate_and_thinks_up_to_max_words():
    rng = np.random.default_rng(1)
    responses = [teacher_response(31, 35, rng, p_correct=0.4, max_words=4) for _ in range(2000)]
    right = exact([None] * 2000, responses, ground_truth=["31 32 33 34 35"] * 2000)
    assert abs(np.mean(right) - 0.4) < 0.03
    words = [len(r.split("</think>")[0].removeprefix("<think>").split()) for r in responses]
    assert set(words) == {0, 1, 2, 3, 4}
    assert all(r.startswith("<think>") and r.endswith("</answer>") for r in responses)


def test_a_right_count_of_k_numbers_takes_3k_plus_2_tokens_and_the_limit_binds(tmp_path, monkeypatch):
    """The study's design: with a limit of 14 tokens, a right answer to a count of 5 or more
    numbers is over the limit whatever the format; 4 fits only without a thought."""
    from transformers import AutoTokenizer

    from gdpo_ray.model_files import resolve_model_path
    from gdpo_ray.run.preflight import check_model, context_length
    from gdpo_ray.models.tiny import MAX_POSITIONS
    from gdpo_ray.models.warm_start import response_ids

    monkeypatch.setenv("GDPO_RAY_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_count, "RECIPE", RECIPE | SMALL)
    path = resolve_model_path("demo-count")
    assert path.parent == tmp_path and path.name.startswith("demo-count-")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1 for t in TAGS)
    for k in range(2, 8):
        answer = "<answer>" + " ".join(str(x) for x in range(52, 52 + k)) + "</answer>"
        assert len(response_ids(tokenizer, answer)) == 3 * k + 2
        assert len(response_ids(tokenizer, "<think></think>" + answer)) == 3 * k + 4
    assert len(response_ids(tokenizer, "<think>count up</think><answer>52 53 54</answer>")) == 15
    monkeypatch.setattr(demo_count, "_warm_start", lambda *a: pytest.fail("built twice"))
    assert resolve_model_path("demo-count") == path  # cached
    check_model("demo-count")  # a built-in name for the start-up checks and for eval
    assert context_length("demo-count") == MAX_POSITIONS
