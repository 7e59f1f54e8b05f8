"""A reward of your own: brevity, 1.0 up to ``limit`` words, falling linearly to 0 at twice that.

Called as TRL's GRPOTrainer calls a reward function (keywords; ``completions`` are strings, or
chat messages for conversational prompts); one float per completion, or None where it cannot be
computed (stored as NaN, left out of that reward's group statistics).
"""


def brevity(completions, limit: int = 8, **kwargs) -> list[float]:
    scores = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        words = len(text.split())
        scores.append(1.0 if words <= limit else max(0.0, 2.0 - words / limit))
    return scores
