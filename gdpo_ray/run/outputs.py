"""A training run's directory: taken atomically, uploaded to storage at the end; its metrics read
back, and at the end a PNG plot of every reward's curve (what writes them: ``gdpo_ray.run.loggers``).

The run directory is ``<run.output_dir>/<run.name>``: a local or shared-filesystem path, or
storage (a URI that ``pyarrow.fs`` opens: ``s3://``, ``gs://``, ``hdfs://``, ``file://``), in
which case the run writes a local staging copy and uploads it when it ends. A run takes its
directory atomically (``OutputDir.create``: ``RUN_LOCK`` created with O_EXCL, then held with
``flock`` while the run writes), so two runs never share one: a named run refuses a directory in
use or used before, an unnamed one gets a fresh name; only ``--resume`` continues a run in its
own directory (appending its metrics), and only when no other process holds it.

    <run_dir>/config.yaml        the resolved config, as a preset (``gdpo-ray train <run_dir>/config.yaml``)
    <run_dir>/metrics.jsonl      one JSON object per step: {"step": s, "time": t, "rewards/format/mean": ...}
    <run_dir>/tensorboard/       the same scalars (``tensorboard --logdir <run_dir>``)
    <run_dir>/rewards.png        rewards/<name>/mean against the step, one panel per reward
    <run_dir>/completions.jsonl  with training.log_completions: N samples per step

A file that cannot be written (a full disk, a quota, a read-only mount) raises ``WriteFailed``
naming it, which ``gdpo-ray train`` reports without a traceback.
"""

from __future__ import annotations

import json
import numbers
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from gdpo_ray.run.checkpoints import WriteFailed, latest_checkpoint

#: in every run directory: created exclusively by the run that takes it, locked while one writes
RUN_LOCK = ".gdpo-run"


def is_run_dir(path: str | Path) -> bool:
    """A directory that a ``gdpo-ray train`` run wrote (its lock, or the metrics of an older one)."""
    return (Path(path) / RUN_LOCK).is_file() or (Path(path) / "metrics.jsonl").is_file()


def checkpoint_run_dir(checkpoint: str | Path) -> Path | None:
    """The run directory a checkpoint belongs to (``<run>/checkpoints/<name>``), or None (one
    saved elsewhere, by the Python API or to ``training.checkpoint_dir``)."""
    path = Path(checkpoint)
    run = path.parent.parent
    return run if path.parent.name == "checkpoints" and is_run_dir(run) else None


class OutputDir:
    """A run's directory (see the module docstring). ``continuing``: the directory of the run
    that ``--resume`` continues."""

    def __init__(self, output_dir: str, name: str | None, stem: str,
                 continuing: str | Path | None = None) -> None:
        self._lock_fd: int | None = None
        self.continuing = continuing is not None
        if continuing is not None:
            self.storage, self.named = False, True
            self.remote, self.local, self.name = None, Path(continuing), Path(continuing).name
            return
        self.storage, self.named = "://" in output_dir, name is not None
        self._base = output_dir.rstrip("/") if self.storage else str(Path(output_dir).expanduser().resolve())
        self._chosen = name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._set(self._base, self._chosen)
        if name is None:
            self._next_free_name()
        elif self.exists():
            raise ValueError(
                f"run directory {self} exists already (run.name={name!r}): its metrics, "
                f"checkpoints and policy would be overwritten; choose another run.name, delete it, "
                f"or continue that run in it with --resume {self}")

    def _set(self, base: str, name: str) -> None:
        self.name = name
        if self.storage:  # a staging copy of its own: two runs never share one
            self.remote = f"{base}/{name}"
            self.local = Path(tempfile.gettempdir()) / "gdpo-ray-staging" / f"{name}-{uuid.uuid4().hex[:8]}"
        else:
            self.remote, self.local = None, Path(base) / name

    def _next_free_name(self, suffix: int = 2) -> None:
        while self.exists():  # two unnamed runs in one second
            self._set(self._base, f"{self._chosen}-{suffix}")
            suffix += 1

    def exists(self) -> bool:
        if self.remote is not None:
            import pyarrow.fs as pafs

            fs, path = pafs.FileSystem.from_uri(self.remote)
            return fs.get_file_info(path).type != pafs.FileType.NotFound
        return self.local.exists() and any(self.local.iterdir())

    def create(self) -> None:
        """Takes the directory for this process: ``RUN_LOCK`` created exclusively (a fresh run;
        the one of two runs that comes second is refused, or renamed when unnamed), then locked
        for as long as the run writes (``release``). Raises ValueError when another run has it.
        Storage: the URI was checked at start-up only (object stores have no exclusive create)."""
        import fcntl
        import socket

        while True:
            self.local.mkdir(parents=True, exist_ok=True)
            try:
                flags = os.O_RDWR | os.O_CREAT | (0 if self.continuing else os.O_EXCL)
                fd = os.open(self.local / RUN_LOCK, flags, 0o644)
                break
            except FileExistsError:
                if self.named:
                    raise ValueError(f"run directory {self} was taken by another run that started "
                                     f"meanwhile (run.name={self.name!r}); choose another run.name") from None
                self._next_free_name()
            except OSError as err:  # a full disk, a read-only mount
                raise WriteFailed("run directory", self.local, err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"run directory {self} is in use by a running gdpo-ray train ({owner}); "
                             f"wait for it to end or stop it (Ctrl-C) first") from None
        self._lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError:  # the owner's name is for messages only
            pass

    def release(self) -> None:
        """The lock back (the directory stays this run's: ``RUN_LOCK`` is kept)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def discard_if_empty(self) -> bool:
        """A fresh run that ended before its first step (nothing logged, no checkpoint): its
        directory removed, so its name can be used again. True if removed."""
        import shutil

        metrics = self.local / "metrics.jsonl"
        logged = metrics.is_file() and metrics.stat().st_size > 0
        if self.continuing or logged or latest_checkpoint(self.local / "checkpoints"):
            return False
        shutil.rmtree(self.local, ignore_errors=True)
        return True

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


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of metrics.jsonl (a step redone after a learner recovery or a resume appears
    again, later); a line cut short is left out, a file that cannot be read gives []."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short (the disk filled up while it was written)
            pass
    return rows


def latest_rows(rows: Sequence[Mapping[str, float]]) -> list[Mapping[str, float]]:
    """One row per step, the last one logged for it (a redone step replaces its first run),
    in step order: the run's history as it stands."""
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def plot_rewards(rows: Sequence[Mapping[str, float]], reward_names: Sequence[str], png: str | Path) -> Path:
    """One panel per reward: its batch mean against the step; then, for runs that evaluate
    (``training.eval_every``), one panel per eval suite: each of its metrics at the eval steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for r in rows for k in r if k.startswith("eval/")):
        suite, _, metric = key.removeprefix("eval/").partition("/")  # (a metric may hold a slash: quality/helpful)
        suites.setdefault(suite, []).append(metric)
    panels = len(reward_names) + len(suites)
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.2), squeeze=False)
    rows = latest_rows(rows)
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
