"""Do two runs agree, step by step, in what the seed decides (rewards, advantages, response
lengths, the learner's numbers), leaving out the clocks (``*_s`` timings, ``time``)?

    python docs/examples/same_runs.py runs/seed7-a runs/seed7-b

Prints "the same over N steps", or the first step where they differ and the metrics that do
(exit status 1).
"""

import sys
from pathlib import Path

from gdpo_ray.run.outputs import latest_rows, read_metrics

COMPARED = ("rewards/", "adv/", "response_length/", "learner/")


def decided(run: str) -> dict[int, dict[str, str]]:
    """Step -> the compared metrics (as repr, so that NaN equals NaN)."""
    rows = latest_rows(read_metrics(Path(run) / "metrics.jsonl"))
    return {int(r["step"]): {k: repr(v) for k, v in r.items() if k.startswith(COMPARED) and not k.endswith("_s")}
            for r in rows}


def first_difference(a: str, b: str) -> str | None:
    ours, theirs = decided(a), decided(b)
    for step in sorted(ours.keys() & theirs.keys()):
        keys = sorted(k for k in ours[step].keys() | theirs[step].keys() if ours[step].get(k) != theirs[step].get(k))
        if keys:
            return f"step {step} differs: {', '.join(keys)}"
    if ours.keys() != theirs.keys():
        return f"steps differ: {len(ours)} and {len(theirs)} logged"
    return None


if __name__ == "__main__":
    found = first_difference(sys.argv[1], sys.argv[2])
    print(found or f"the same over {len(decided(sys.argv[1]))} steps")
    sys.exit(1 if found else 0)
