"""What a training run leaves in its run directory: metrics per step as JSONL and TensorBoard
event files, and at the end a PNG plot of every reward's curve.

    <run_dir>/metrics.jsonl      one JSON object per step: {"step": s, "rewards/format/mean": ...}
    <run_dir>/tensorboard/       the same scalars (``tensorboard --logdir <run_dir>``)
    <run_dir>/rewards.png        rewards/<name>/mean against the step, one panel per reward
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Mapping, Sequence


def flat_scalars(result: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a (nested) result dict, keys joined with '/'."""
    out: dict[str, float] = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flat_scalars(value, name + "/")
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy scalars too
            out[name] = float(value)
    return out


class RunLog:
    """Appends one step's scalars to metrics.jsonl and TensorBoard."""

    def __init__(self, run_dir: str | Path) -> None:
        from tensorboardX import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        row = {"step": step} | {k: v for k, v in scalars.items() if k != "step"}
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        for key, value in scalars.items():
            if key != "step" and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_rewards(rows: Sequence[Mapping[str, float]], reward_names: Sequence[str], png: str | Path) -> Path:
    """One panel per reward: its batch mean against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reward_names), figsize=(4 * len(reward_names), 3.2), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, name in zip(axes[0], reward_names):
        ax.plot(steps, [r.get(f"rewards/{name}/mean", float("nan")) for r in rows], marker=".")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("batch mean")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)
