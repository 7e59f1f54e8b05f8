"""The judge pool on the vllm engine (judges.judge_engine: vllm), for real: a judge actor answers a
batch of judge messages greedily, as the same model's greedy decoding on the hf engine does."""

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vllm install set runs these: scripts/test-vllm-cpu.sh")


def test_a_vllm_judge_actor_answers_as_the_hf_judge_does(ray_cluster, tiny_model_dir):
    from actors.judge_pool import JudgePool
    from gdpo_ray.judges.rubric import rubric_of, expand_judges
    from gdpo_ray.judges.verdict import render

    rubric = rubric_of(expand_judges([{"name": "q", "fn": "judge", "judge": {"model": tiny_model_dir},
                                       "criteria": [{"name": "ok", "describe": "fine"}]}])[0]["params"])
    messages = [render(None, rubric.criteria, "What is 2 + 2?", answer, {}) for answer in ("4", "five")]
    answers = {}
    for engine, kwargs in (("vllm", {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}), ("hf", {})):
        pool = JudgePool(tiny_model_dir, num_judges=1, num_cpus=0, engine=engine, engine_kwargs=kwargs)
        try:
            answers[engine] = ray_cluster.get(pool.handles[0].judge.remote(messages, 12, 0.0))
        finally:
            pool.shutdown()
    assert all(error == "" and tokens > 12 for _, tokens, error in answers["vllm"])
    # greedy decoding of the same float32 model: the same answers (ties in the logits aside)
    assert [text for text, _, _ in answers["vllm"]] == [text for text, _, _ in answers["hf"]]
