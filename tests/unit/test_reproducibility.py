"""What docs/reproducibility.md says of the seed, kept true: ``debugging.seed`` (None: 0) reaches
the prompts, the rollout actors and the learners; the task rows and the prompt order follow it;
the hf engine's samples follow its seed, call by call."""

import pytest

from gdpo_ray import GDPOConfig
from gdpo_ray.data import load_prompts
from gdpo_ray.run.presets import apply_sections, load_preset


def demo(*overrides):
    return apply_sections(GDPOConfig(), load_preset("demo", list(overrides)))


def test_debugging_seed_reaches_the_rollout_actors_and_the_learners():
    seeded = demo("debugging.seed=7")
    assert seeded.seed == 7
    assert seeded.rollout_actor_kwargs["seed"] == 7 and seeded.learner_config.seed == 7
    unseeded = demo()  # no seed is seed 0, not a fresh one per run
    assert unseeded.seed is None
    assert unseeded.rollout_actor_kwargs["seed"] == 0 and unseeded.learner_config.seed == 0


def test_the_seed_is_refused_in_the_training_section_with_its_home():
    with pytest.raises(ValueError, match="it is `debugging.seed`"):
        demo("training.seed=7")


def test_task_rows_and_prompt_order_follow_the_seed():
    from actors.prompts import PromptSource

    assert load_prompts("task:arithmetic", 20, 7) == load_prompts("task:arithmetic", 20, 7)
    assert load_prompts("task:arithmetic", 20, 7) != load_prompts("task:arithmetic", 20, 8)
    rows = load_prompts("task:addition", 20, 0)

    def order(seed):
        return [p.prompt_id for p in PromptSource(rows, seed=seed).take(20)]

    assert order(7) == order(7) and order(7) != order(8)


def test_hf_samples_follow_the_seed_call_by_call(tiny_model_dir):
    from actors.engines import SamplingParams
    from actors.hf_engine import HFEngine

    sampling = SamplingParams(temperature=1.0, max_tokens=8)

    def calls(seed, n_calls=2):
        engine = HFEngine(tiny_model_dir, seed=seed)
        prompt = engine.tokenizer("What is 2 + 2?")["input_ids"]
        return [[s.token_ids for s in engine.generate([prompt], 4, sampling)[0]] for _ in range(n_calls)]

    first, second = calls(7)
    assert calls(7) == [first, second]  # the same seed: the same samples, call by call
    assert first != second  # each call its own draw
    assert calls(8)[0] != first


def test_the_page_s_check_of_two_runs(tmp_path):
    """docs/examples/same_runs.py, as the page runs it: the clocks left out, a difference named."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def run(name, loss_at_2):
        rows = [{"step": 1, "time": 10.0, "rewards/format/mean": 0.5, "adv/format/share": float("nan"),
                 "learner/loss": 0.1, "learner/time_s": 3.0, "timing/step_s": 4.0},
                {"step": 2, "time": 20.0 + loss_at_2, "rewards/format/mean": 0.7, "learner/loss": loss_at_2,
                 "timing/step_s": 5.0 + loss_at_2}]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    script = Path(__file__).resolve().parents[2] / "docs" / "examples" / "same_runs.py"
    a, b, c = run("a", 0.2), run("b", 0.2), run("c", 0.3)
    same = subprocess.run([sys.executable, str(script), a, b], capture_output=True, text=True, timeout=60)
    assert (same.returncode, same.stdout.strip()) == (0, "the same over 2 steps"), same.stderr
    differ = subprocess.run([sys.executable, str(script), a, c], capture_output=True, text=True, timeout=60)
    assert (differ.returncode, differ.stdout.strip()) == (1, "step 2 differs: learner/loss"), differ.stderr
