"""The GPU-scale presets (the paper's tool calling, math, code; BFCL multi-turn), shrunk to one
CPU step each: the tiny model instead of the GPU one, hf instead of vLLM, one actor and one
learner. What stays as shipped: the task, the rewards (ToolRL's two, math's two, code's three
with the conditioned length, BFCL's format, state and response over multi-turn conversations on
its APIs) and the loss settings. And the CPU agent preset, whole: it learns."""

import math

import pytest

pytestmark = pytest.mark.slow

CPU = ["llm.model_path=tiny", "llm.max_prompt_tokens=1000", "data.num_prompts=8",
       "generation.engine=hf", "generation.engine_kwargs={}", "generation.max_tokens=16",
       "generation.prompts_per_call=2", "generation.reward_workers=1",
       "training.group_size=2", "training.prompts_per_step=2", "training.precision=fp32",
       "training.dynamic_sampling=false",  # a random model rarely varies a reward
       "env_runners.num_env_runners=1", "env_runners.num_gpus_per_env_runner=0",
       "env_runners.num_cpus_per_env_runner=1",
       "learners.num_learners=1", "learners.num_gpus_per_learner=0"]


def verl_parquet(path, task):
    """The rows of a built-in task laid out as verl's parquet files are (chat prompt, answer in
    reward_model.ground_truth), as DeepScaleR, Eurus-2-RL and ToolRL are distributed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gdpo_ray.tasks import task_rows

    rows = [{"data_source": task, "prompt": [{"role": "user", "content": r["prompt"]}],
             "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
             "extra_info": {"index": i}} for i, r in enumerate(task_rows(f"task:{task}", 8))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("preset, rewards, verl_task", [
    ("tool_calling", {"format": (0, 1), "correctness": (-3, 3)}, None),
    ("math", {"correct": (0, 1), "length": (0, 1)}, "arithmetic"),  # the data as verl has it
    ("code", {"passrate": (0, 1), "length": (0, 1), "bug": (0, 1)}, None),
    ("bfcl_multi_turn", {"format": (0, 1), "state": (0, 1), "response": (0, 1), "valid": (0, 1)}, None),
])
def test_paper_preset_trains_a_step_on_cpu(ray_cluster, tmp_path, preset, rewards, verl_task):
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    data = [] if verl_task is None else [
        f"data.prompts={verl_parquet(tmp_path / 'train.parquet', verl_task)}",
        "data.columns={ground_truth: reward_model.ground_truth}"]
    config = apply_sections(GDPOConfig(), load_preset(preset, CPU + data))
    algo = config.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["groups"] == 2 and math.isfinite(result["learner/loss"])
    for name, (low, high) in rewards.items():
        assert low <= result[f"rewards/{name}/mean"] <= high, name
        assert result[f"rewards/{name}/failure_rate"] == 0, name  # every reward was computed
    assert not any(k.startswith("rewards/") and k.split("/")[1] not in rewards
                   for k in result if k.endswith("/mean"))


def test_the_agent_preset_learns_to_call_its_tools(ray_cluster):
    """``gdpo-ray train agent`` as shipped (30 steps): each of its three rewards rises."""
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    algo = apply_sections(GDPOConfig(), load_preset("agent")).build_algo()
    try:
        results = [algo.train() for _ in range(30)]
    finally:
        algo.stop()
    for name in ("format", "tool_success", "answer"):
        first = sum(r[f"rewards/{name}/mean"] for r in results[:3]) / 3
        last = sum(r[f"rewards/{name}/mean"] for r in results[-3:]) / 3
        assert last > first + 0.2 and last > 0.7, (name, first, last)
        assert all(r[f"rewards/{name}/failure_rate"] == 0 for r in results), name
    assert results[-1]["rollout/tool_calls/mean"] > results[0]["rollout/tool_calls/mean"]
