"""``gdpo-ray train``: a preset and overrides -> a validated GDPOConfig -> Ray -> the training loop
with a progress bar, metrics (JSONL + TensorBoard), checkpoints, the final policy as a Hugging
Face directory and a PNG of the reward curves, all under one run directory.

Ray: inside ``ray job submit`` (``RAY_ADDRESS`` set) or with ``run.address`` the run joins that
cluster; otherwise it starts a local Ray with ``run.num_cpus`` logical CPUs and token
authentication off (``RAY_AUTH_MODE=disabled``, the local-cluster setting).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

RUN_DEFAULTS = {"steps": 40, "output_dir": "runs", "num_cpus": 4, "address": None, "name": None,
                "checkpoint_at_end": True, "export_policy": True}
#: quiet workers: no per-actor progress bars of transformers / huggingface_hub
WORKER_ENV = {"RAY_AUTH_MODE": "disabled", "TRANSFORMERS_VERBOSITY": "error",
              "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
              "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}


class TrainingRun:
    def __init__(self, config: Any, run: dict, preset: str, resume: str | None = None) -> None:
        self.config, self.run_settings, self.preset, self.resume = config, run, preset, resume
        self.changes: list = []  # settings that differ from the resumed checkpoint's
        name = run["name"] or f"{Path(preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.run_dir = Path(run["output_dir"]).resolve() / name

    @classmethod
    def from_args(cls, config: str | None, overrides: Sequence[str] = (), resume: str | None = None):
        from gdpo_ray.algorithm import GDPOConfig
        from gdpo_ray.config import apply_sections, load_preset

        if config is not None and "=" in config:  # `gdpo-ray train training.lr=1e-4`
            config, overrides = None, [config, *overrides]
        sections = load_preset(config, overrides)
        run = dict(RUN_DEFAULTS)
        unknown = set(sections.get("run") or {}) - set(RUN_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown run setting(s) {sorted(unknown)}; run settings: {sorted(RUN_DEFAULTS)}")
        run |= sections.get("run") or {}
        if not (isinstance(run["steps"], int) and run["steps"] >= 1):
            raise ValueError(f"run.steps must be an integer >= 1; got {run['steps']!r}")
        gdpo = apply_sections(GDPOConfig(), sections)
        self = cls(gdpo, run, config or "demo", resume)
        if gdpo.checkpoint_dir is None:
            gdpo.checkpoint_dir = str(self.run_dir / "checkpoints")
        gdpo.validate()
        if resume:
            from gdpo_ray.algorithm import resume_changes

            if not Path(resume).is_dir():
                raise ValueError(f"--resume {resume}: no such checkpoint directory")
            self.changes = resume_changes(gdpo, resume)
        return self

    def _start_ray(self) -> None:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        root = str(Path(__file__).resolve().parents[1])
        env = {"env_vars": WORKER_ENV | {"PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}}
        address = self.run_settings["address"] or os.environ.get("RAY_ADDRESS")
        if ray.is_initialized():
            return
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(num_cpus=self.run_settings["num_cpus"], include_dashboard=False,
                     logging_level=logging.WARNING, runtime_env=env)

    def run(self) -> int:
        from tqdm import tqdm

        from gdpo_ray.run_outputs import RunLog, flat_scalars, plot_rewards, read_metrics

        steps = self.run_settings["steps"]
        print(f"gdpo-ray: run directory {self.run_dir}", flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._start_ray()
        algo = self.config.build_algo()
        if self.resume:  # this run's config, the checkpoint's state (weights, optimizer, prompts)
            for name, old, new in self.changes:
                print(f"gdpo-ray: resuming with {name} {old!r} -> {new!r}")
            algo.restore_from_path(self.resume)
        names = algo.reward_names
        log = RunLog(self.run_dir)
        try:
            bar = tqdm(total=steps, initial=algo.policy_version, desc="gdpo", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
            placed = None  # (actors, nodes) of the rollout group: elastic runs change it
            while algo.policy_version < steps:
                scalars = flat_scalars(algo.train())
                log.log(algo.policy_version, scalars)
                now = (int(scalars.get("rollout/actors", 0)), int(scalars.get("rollout/nodes", 0)))
                if now != placed:
                    bar.write(f"gdpo-ray: rollout actors {now[0]} on {now[1]} node(s)")
                    placed = now
                bar.set_postfix({n: f"{scalars.get(f'rewards/{n}/mean', float('nan')):.2f}" for n in names})
                bar.update(algo.policy_version - bar.n)
            bar.close()
            if self.run_settings["checkpoint_at_end"]:
                print(f"gdpo-ray: checkpoint {algo.save_to_path(str(self.run_dir / 'checkpoints' / 'final'))}")
            if self.run_settings["export_policy"]:
                print(f"gdpo-ray: policy (Hugging Face format) {algo.export_policy(str(self.run_dir / 'policy'))}")
        finally:
            log.close()
            algo.stop()
        rows = read_metrics(log.path)
        if rows:
            plot_rewards(rows, names, self.run_dir / "rewards.png")
            print(summary(rows, names))
        print(f"gdpo-ray: metrics {log.path}, plot {self.run_dir / 'rewards.png'}, "
              f"TensorBoard {self.run_dir / 'tensorboard'}")
        print(f"gdpo-ray: run directory {self.run_dir}", flush=True)
        return 0


def summary(rows: Sequence[dict], names: Sequence[str], window: int = 3) -> str:
    """Each reward's mean over the first and the last ``window`` steps."""
    import numpy as np

    lines = [f"{'reward':<12} {'first':>7} {'last':>7}"]
    for name in names:
        values = [r.get(f"rewards/{name}/mean", float("nan")) for r in rows]
        lines.append(f"{name:<12} {np.nanmean(values[:window]):>7.3f} {np.nanmean(values[-window:]):>7.3f}")
    return "\n".join(lines)
