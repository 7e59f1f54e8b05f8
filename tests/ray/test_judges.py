"""Judges on a local Ray cluster: the judge pool's actors (batches, a dead actor replaced and its
calls re-issued), a rollout actor judging a rubric of three criteria through a real HTTP endpoint
and through the pool (each criterion its own column, the advantage GDPO's of the three), and
GDPO training with judges, faults included, going on."""

import math

import numpy as np
import pytest

from gdpo_ray import GDPOConfig
from gdpo_ray.advantages import compute_advantage_details
from gdpo_ray.rewards import reward_specs
from gdpo_ray.run.presets import apply_sections, load_preset
from tests.judge_server import JudgeServer, expected_score

ENGINE = "tests.judge_server:VerdictEngine"
CRITERIA = [{"name": "helpful", "describe": "answers the question", "scale": [0, 1]},
            {"name": "concise", "describe": "no needless words", "scale": [0, 1], "weight": 0.5},
            {"name": "kind", "describe": "polite", "scale": [0, 1], "weight": 2.0}]


def rubric(judge):
    return {"name": "quality", "fn": "judge", "judge": judge, "criteria": CRITERIA}


def response_text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_the_pool_batches_and_replaces_a_dead_actor_with_nothing_lost(ray_cluster, tiny_model_dir):
    import threading
    import time

    from actors.judge_pool import JudgePool
    from actors.judging import Judging

    pool = JudgePool(tiny_model_dir, num_judges=2, num_cpus=0, engine=ENGINE, engine_kwargs={"slow_s": 4.0})
    judging = Judging(reward_specs([rubric({"model": tiny_model_dir, "timeout_s": 60})]), pool.handles, batch_size=1)
    try:
        responses = ["SLOW a", "SLOW bb", "ccc", "dddd"]
        killer = threading.Timer(1.5, lambda: ray_cluster.kill(pool.handles[0], no_restart=False))
        killer.start()
        start = time.perf_counter()
        columns = judging.collector(judging.submit(["q"] * 4, responses, [{}] * 4), 4)()
        stats = judging.take_stats()
        killer.join()
        for name in ("helpful", "concise", "kind"):
            values, kinds, _ = columns[f"quality/{name}"]
            assert values == [expected_score(name, r) for r in responses] and kinds == [""] * 4
        assert stats["retries"] >= 1 and stats["failures"] == 0 and stats["calls"] == 4
        assert time.perf_counter() - start < 40
        # the killed actor was restarted by Ray and serves again under the same handle
        assert ray_cluster.get(pool.handles[0].ready.remote(), timeout=60)
    finally:
        judging.close()
        pool.shutdown()


def judged_batch(tiny_model_dir, judge, pool=None):
    """One rollout actor (in this process) with a format reward and the three criteria: a call's
    batch, its rewards matrix and the responses' texts."""
    import asyncio

    from actors.prompts import Prompt
    from actors.rollout import RolloutActor

    rewards = [{"name": "format", "fn": "regex", "params": {"pattern": r"\d"}}, rubric(judge)]
    actor = RolloutActor(tiny_model_dir, rewards, group_size=4, sampling={"max_tokens": 12}, judges=pool)
    try:
        prompts = [Prompt(prompt_id=str(i), row=i, epoch=0, attempt=0, prompt=f"What is {i} + 1?", columns={})
                   for i in range(3)]
        meta, batch = asyncio.run(actor.generate(prompts))
    finally:
        asyncio.run(actor.shutdown())
    rewards = batch.column("rewards").flatten().to_numpy().reshape(-1, 4)
    texts = [response_text(actor.tokenizer, ids) for ids in batch.column("response_token_ids").to_pylist()]
    return meta, batch, rewards, texts


def assert_gdpo_of_the_columns(rewards, texts, weights):
    """Each criterion's column is the judge's verdict, and the advantage is GDPO's of the four
    columns: each normalized within its group, the weighted sum normalized over the batch."""
    for k, name in enumerate(("helpful", "concise", "kind"), start=1):
        np.testing.assert_array_equal(rewards[:, k], [expected_score(name, t) for t in texts])
    details = compute_advantage_details(rewards.astype(np.float64), np.repeat(np.arange(3), 4), estimator="gdpo",
                                        weights=np.array(weights), eps=1e-6)
    grouped = rewards.astype(np.float64).reshape(3, 4, 4)
    normalized = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-6)
    normalized = np.where(grouped.std(1, ddof=1, keepdims=True) > 0, normalized, 0.0).reshape(12, 4)
    summed = normalized @ np.array(weights)
    reference = (summed - summed.mean()) / (summed.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(details.advantages, reference, rtol=1e-6, atol=1e-6)


def test_a_three_criterion_rubric_through_an_endpoint_is_three_gdpo_columns(ray_cluster, tiny_model_dir):
    with JudgeServer() as server:
        meta, batch, rewards, texts = judged_batch(tiny_model_dir, {"url": server.url, "model": "m"})
    from gdpo_ray.batch import reward_names

    assert reward_names(batch.schema) == ["format", "quality/helpful", "quality/concise", "quality/kind"]
    assert meta.judge["calls"] == len(set(texts)) and meta.judge["cached"] == 12 - len(set(texts))
    assert_gdpo_of_the_columns(rewards, texts, [1.0, 1.0, 0.5, 2.0])


def test_a_three_criterion_rubric_through_the_pool_is_three_gdpo_columns(ray_cluster, tiny_model_dir):
    from actors.judge_pool import JudgePool

    pool = JudgePool(tiny_model_dir, num_judges=1, num_cpus=0, engine=ENGINE)
    try:
        meta, batch, rewards, texts = judged_batch(tiny_model_dir, {"model": tiny_model_dir}, pool.handles)
    finally:
        pool.shutdown()
    assert meta.judge["calls"] == len(set(texts))
    assert_gdpo_of_the_columns(rewards, texts, [1.0, 1.0, 0.5, 2.0])


def judge_config(judge, *overrides):
    base = ["training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=24",
            "generation.prompts_per_call=4", "training.reward_failure_limit=2"]
    config = apply_sections(GDPOConfig(), load_preset("demo", base + list(overrides)))
    return config.training(rewards=[*config.rewards, rubric(judge)])


@pytest.mark.parametrize("fault", ["500", "slow", "dead actor"])
def test_gdpo_trains_with_a_judge_through_faults(ray_cluster, fault, monkeypatch):
    """Steps of the demo with a three-criterion judge through a fault: an endpoint whose first
    answer to every message is a 500, or a timeout (each retried and then judged), and every
    fifth message answered without a verdict (NaN, counted, never 0); or the pool with its actor
    killed between steps (restarted, the next step judged). The run goes on."""
    import gdpo_ray.judges.endpoint as endpoint

    monkeypatch.setattr(endpoint, "BACKOFF_S", 0.01)
    served = fault == "dead actor"
    server = None if served else JudgeServer(slow_s=3, fault_first=fault, malformed_every=5)
    try:
        judge = ({"model": "demo"} if served else {"url": server.url, "model": "m", "timeout_s": 1, "retries": 1})
        config = judge_config(judge, f"judges.judge_engine={ENGINE}", "judges.num_cpus_per_judge=0")
        algo = config.build_algo()
        try:
            results = [algo.train()]
            if served:
                ray_cluster.kill(algo.judge_pool.handles[0], no_restart=False)
            results.append(algo.train())
        finally:
            algo.stop()
    finally:
        if server is not None:
            server.close()
    for result in results:
        for name in ("helpful", "concise", "kind"):
            assert 0.0 <= result[f"rewards/quality/{name}/mean"] <= 1.0
        assert result["judge/calls"] >= 0  # (a step's groups may all have been judged before it)
        if result["judge/calls"]:
            assert result["judge/latency_p95_s"] >= result["judge/latency_s"] > 0
    assert sum(r["judge/calls"] for r in results) > 0
    if served:
        assert sum(r["judge/failures"] for r in results) == 0
    else:
        assert all(r["judge/retries"] >= r["judge/calls"] for r in results)  # each first answer failed
        failures = sum(r["judge/failures"] for r in results)  # of every call judged, trained or not yet
        assert failures > 0 and failures % 3 == 0 and server.malformed  # a malformed answer fails its 3 criteria
        assert sum(r["rewards/quality/helpful/failure_rate"] for r in results) > 0
    assert math.isfinite(results[-1]["adv/quality/kind/share"])
