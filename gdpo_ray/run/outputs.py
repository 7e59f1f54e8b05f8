"""What a training run leaves in its run directory: metrics per step as JSONL and TensorBoard
event files, and at the end a PNG plot of every reward's curve.

The run directory is ``<run.output_dir>/<run.name>``: a local or shared-filesystem path, or
storage (a URI that ``pyarrow.fs`` opens: ``s3://``, ``gs://``, ``hdfs://``, ``file://``), in
which case the run writes a local staging copy and uploads it when it ends. An existing run
directory is never written into: a named run refuses it, an unnamed one gets a fresh name.

    <run_dir>/metrics.jsonl      one JSON object per step: {"step": s, "time": t, "rewards/format/mean": ...}
    <run_dir>/tensorboard/       the same scalars (``tensorboard --logdir <run_dir>``)
    <run_dir>/rewards.png        rewards/<name>/mean against the step, one panel per reward
"""

from __future__ import annotations

import json
import math
import numbers
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence


class OutputDir:
    """A run's directory (see the module docstring)."""

    def __init__(self, output_dir: str, name: str | None, stem: str) -> None:
        self.storage = "://" in output_dir
        base = output_dir.rstrip("/") if self.storage else str(Path(output_dir).expanduser().resolve())
        chosen = name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._set(base, chosen)
        if name is None:
            suffix = 2
            while self.exists():  # two unnamed runs in one second
                self._set(base, f"{chosen}-{suffix}")
                suffix += 1
        elif self.exists():
            raise ValueError(
                f"run directory {self} exists already (run.name={name!r}): its metrics, "
                f"checkpoints and policy would be overwritten; choose another run.name, delete it, "
                f"or continue its training as a new run with --resume {self}/checkpoints/final "
                f"run.name=<new name>")

    def _set(self, base: str, name: str) -> None:
        self.name = name
        if self.storage:
            self.remote = f"{base}/{name}"
            self.local = Path(tempfile.gettempdir()) / "gdpo-ray-staging" / name
        else:
            self.remote, self.local = None, Path(base) / name

    def exists(self) -> bool:
        if self.remote is not None:
            import pyarrow.fs as pafs

            fs, path = pafs.FileSystem.from_uri(self.remote)
            return fs.get_file_info(path).type != pafs.FileType.NotFound
        return self.local.exists() and any(self.local.iterdir())

    def create(self) -> None:
        if self.remote is not None and self.local.exists():
            import shutil

            shutil.rmtree(self.local)  # a stale staging copy
        self.local.mkdir(parents=True, exist_ok=True)

    def upload(self) -> None:
        """Storage: the local staging copy to the run's URI."""
        if self.remote is not None:
            import pyarrow.fs as pafs

            fs, path = pafs.FileSystem.from_uri(self.remote)
            fs.create_dir(path, recursive=True)
            pafs.copy_files(str(self.local), path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)

    def __truediv__(self, name: str) -> str:
        return f"{self}/{name}"

    def __str__(self) -> str:
        return self.remote or str(self.local)


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


#: metrics logged on some steps only (training.eval_every)
SOME_STEPS = ("eval/", "timing/eval_s")


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
        # metrics of some steps only (the evals): RLlib reports NaN for them in between, left out
        scalars = {k: v for k, v in scalars.items() if not (k.startswith(SOME_STEPS) and math.isnan(v))}
        # "time": the wall clock (Unix seconds) when the step ended
        row = {"step": step, "time": round(time.time(), 3)} | {k: v for k, v in scalars.items()
                                                              if k not in ("step", "time")}
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
    """One panel per reward: its batch mean against the step; then, for runs that evaluate
    (``training.eval_every``), one panel per eval suite: each of its metrics at the eval steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for r in rows for k in r if k.startswith("eval/")):
        suite, _, metric = key.removeprefix("eval/").rpartition("/")
        suites.setdefault(suite, []).append(metric)
    panels = len(reward_names) + len(suites)
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.2), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, name in zip(axes[0], reward_names):
        ax.plot(steps, [r.get(f"rewards/{name}/mean", float("nan")) for r in rows], marker=".")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("batch mean")
    for ax, (suite, metrics) in zip(axes[0][len(reward_names):], suites.items()):
        for metric in metrics:
            at = [(r["step"], r[f"eval/{suite}/{metric}"]) for r in rows if f"eval/{suite}/{metric}" in r]
            ax.plot([s for s, _ in at], [v for _, v in at], marker="o", label=metric)
        ax.set_title(f"eval: {suite}")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)
