"""Reward functions in the shapes TRL's GRPOTrainer documentation shows (written here, not
copied), imported by the scoring pool's workers as a user's module would be."""

import asyncio
import re
import time


def length_target(completions, **kwargs):
    """Standard format: completions are strings; prefer 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def think_answer_format(completions, **kwargs):
    """Conversational format: each completion is a list holding one assistant message."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    texts = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, text) else 0.0 for text in texts]


def boxed_equals(completions, ground_truth, **kwargs):
    """A dataset column by name, beside **kwargs."""
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    return [1.0 if m and m.group(1) == gt else 0.0 for m, gt in zip(found, ground_truth)]


def prompt_echo(prompts, completions, **kwargs):
    """Uses the prompts: 1 where the completion repeats the prompt's last word."""
    return [float(p.split()[-1] in c) for p, c in zip(prompts, completions)]


def token_count(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def step_seen(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step) for _ in completions]


def only_some(completions, **kwargs):
    """None: not applicable to this sample (NaN, as in TRL)."""
    return [None if c.startswith("skip") else 1.0 for c in completions]


def no_kwargs(completions, ground_truth):
    """Names only what it needs, without **kwargs."""
    return [float(c == gt) for c, gt in zip(completions, ground_truth)]


async def judged(completions, **kwargs):
    """An async reward (a remote judge, say)."""
    await asyncio.sleep(0)
    return [0.5 for _ in completions]


def sleep_on_odd(completions, **kwargs):
    """Hangs on a call that holds an odd number (waiting, using no CPU)."""
    if any(int(c) % 2 for c in completions):
        time.sleep(600)
    return [1.0 for _ in completions]


def busy(completions, **kwargs):
    """Computes for 0.3 s (a CPU-bound reward)."""
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    return [1.0 for _ in completions]
