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
from pathlib import Path
from typing import Any, Sequence

RUN_DEFAULTS = {"steps": 40, "output_dir": "runs", "num_cpus": 4, "address": None, "name": None,
                "checkpoint_at_end": True, "export_policy": True}
RUN_KINDS = {"steps": int, "output_dir": str, "num_cpus": int, "address": (str, type(None)),
             "name": (str, type(None)), "checkpoint_at_end": bool, "export_policy": bool}
#: quiet workers: no per-actor progress bars of transformers / huggingface_hub
WORKER_ENV = {"RAY_AUTH_MODE": "disabled", "TRANSFORMERS_VERBOSITY": "error",
              "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
              "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}


#: a local cluster starts no idle workers ahead of time: every actor of a run asks for a runtime
#: env of its own, so none could take one, and each costs a core-second and ~40 MB at start-up
LOCAL_RAY_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def run_settings(sections: dict) -> dict:
    """The ``run`` section with its defaults, checked (names, kinds)."""
    from gdpo_ray.config import unknown_key

    given = sections.get("run") or {}
    if not isinstance(given, dict):
        raise ValueError(f"section 'run' must be a mapping of settings; got {given!r}")
    for key in given:
        if key not in RUN_DEFAULTS:
            raise ValueError(unknown_key(key, list(RUN_DEFAULTS), "section 'run'"))
    run = dict(RUN_DEFAULTS) | given
    for key, kind in RUN_KINDS.items():
        if not isinstance(run[key], kind) or (kind is int and isinstance(run[key], bool)):
            raise ValueError(f"run.{key} must be {getattr(kind, '__name__', 'a string or null')}; "
                             f"got {run[key]!r}")
    if run["steps"] < 1:
        raise ValueError(f"run.steps must be an integer >= 1; got {run['steps']!r}")
    return run


def in_temporary_working_dir(path: Path) -> bool:
    """Inside Ray's copy of a job's working dir (deleted with the job's files)."""
    return "runtime_resources" in path.parts and any(p.startswith("session_") for p in path.parts)


class TrainingRun:
    def __init__(self, config: Any, run: dict, preset: str, resume: str | None = None) -> None:
        from gdpo_ray.run.outputs import OutputDir

        self.config, self.run_settings, self.preset, self.resume = config, run, preset, resume
        self.changes: list = []  # settings that differ from the resumed checkpoint's
        self.outputs = OutputDir(run["output_dir"], run["name"], Path(preset).stem)
        self.run_dir = self.outputs.local

    @classmethod
    def from_args(cls, config: str | None, overrides: Sequence[str] = (), resume: str | None = None):
        from gdpo_ray.run.algorithm import GDPOConfig
        from gdpo_ray.run.presets import apply_sections, load_preset

        if config is not None and "=" in config:  # `gdpo-ray train training.lr=1e-4`
            config, overrides = None, [config, *overrides]
        sections = load_preset(config, overrides)
        run = run_settings(sections)
        gdpo = apply_sections(GDPOConfig(), sections)
        if resume:  # relative to where the command runs, as the user typed it
            resume = str(Path(resume).expanduser().resolve())
        self = cls(gdpo, run, config or "demo", resume)
        if gdpo.checkpoint_dir is None:
            gdpo.checkpoint_dir = str(self.run_dir / "checkpoints")
        gdpo.validate()
        if resume:
            from gdpo_ray.run.checkpoints import resume_changes

            if not Path(resume).is_dir():
                raise ValueError(f"--resume {resume}: no such checkpoint directory")
            self.changes = resume_changes(gdpo, resume)
        return self

    def check(self, out=print):
        """The start-up checks (``gdpo_ray.run.preflight``): model, dataset, rewards on sample rows."""
        from gdpo_ray.run.preflight import preflight

        report = preflight(self.config)
        out(f"gdpo-ray: start-up check passed: {report.rows} dataset rows, rewards "
            f"{', '.join(report.names)} scored on sample rows")
        for warning in report.warnings:
            out(f"gdpo-ray: warning: {warning}")
        return report

    def _start_ray(self) -> None:
        address = self.run_settings["address"]
        start_ray(address, self.run_settings["num_cpus"], user_modules(self.config) if address else [])

    def _final_eval(self, algo: Any) -> None:
        """With an eval suite: the final policy's report in the run's eval/ (the last scheduled
        eval when it was of this version, else one now), for ``gdpo-ray eval --compare``."""
        from gdpo_ray.eval.report import format_report, report_path, write_report

        if algo.eval_suite is None:
            return
        report = algo.last_eval
        if report is None or report.get("step") != algo.policy_version:
            report = algo.evaluate_policy()
        if report is not None:
            report["policy"] = str(self.run_dir / "policy")
            path = write_report(report, report_path(self.run_dir, report["suite"]))
            print(format_report(report))
            print(f"gdpo-ray: eval report {path}")

    def run(self) -> int:
        from tqdm import tqdm

        from gdpo_ray.run.outputs import RunLog, flat_scalars, plot_rewards, read_metrics

        steps = self.run_settings["steps"]
        self.check()  # before the run directory, Ray or any actor
        if in_temporary_working_dir(self.run_dir):
            print(f"gdpo-ray: warning: outputs go to {self.run_dir}, inside Ray's temporary copy "
                  f"of the job's working dir, which Ray deletes; set run.output_dir to a shared "
                  f"path (run.output_dir=/mnt/shared/runs) or to storage (s3://bucket/runs)",
                  file=sys.stderr, flush=True)
        self.outputs.create()
        print(f"gdpo-ray: run directory {self.outputs}", flush=True)
        if self.resume:
            print(f"gdpo-ray: resuming from {self.resume}", flush=True)
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
            self._final_eval(algo)
        finally:
            log.close()
            algo.stop()
            rows = read_metrics(log.path)
            if rows:
                plot_rewards(rows, names, self.run_dir / "rewards.png")
            self.outputs.upload()
        if rows:
            print(summary(rows, names))
        print(f"gdpo-ray: metrics {self.outputs / 'metrics.jsonl'}, plot "
              f"{self.outputs / 'rewards.png'}, TensorBoard {self.outputs / 'tensorboard'}")
        print(f"gdpo-ray: run directory {self.outputs}", flush=True)
        return 0


def start_ray(address: str | None, num_cpus: int, py_modules: list[str]) -> None:
    """Ray for a run (a no-op when it is up already): the job's cluster inside `ray job
    submit`, the cluster at ``address`` (``py_modules``, the user's reward modules, go along),
    else a local cluster of ``num_cpus`` CPUs whose workers import from this checkout and from
    the current folder."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    root = str(Path(__file__).resolve().parents[1])
    if os.environ.get("RAY_ADDRESS"):  # inside `ray job submit`: the job's runtime env holds
        ray.init(logging_level=logging.WARNING)  # (working_dir: the user's code)
    elif address:
        ray.init(address=address, logging_level=logging.WARNING,
                 runtime_env={"env_vars": WORKER_ENV, "py_modules": py_modules})
    else:
        path = os.pathsep.join(p for p in (root, os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=num_cpus, include_dashboard=False,
                 logging_level=logging.WARNING, _system_config=LOCAL_RAY_CONFIG,
                 runtime_env={"env_vars": WORKER_ENV | {"PYTHONPATH": path}})


def user_modules(config: Any) -> list[str]:
    """The files or packages of the rewards' own modules that live outside installed packages
    (``my_rewards:fn`` beside the config): shipped to a cluster's workers as ``py_modules``."""
    import importlib.util
    import site
    import sysconfig

    installed = [Path(p).resolve() for p in (*site.getsitepackages(), sysconfig.get_paths()["stdlib"])]
    out: list[str] = []
    for reward in config.rewards:
        fn = reward.get("fn") or reward.get("name") if isinstance(reward, dict) else None
        if not isinstance(fn, str) or ":" not in fn:
            continue
        top = fn.removeprefix("verl:").split(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.origin or top in ("gdpo_ray", "actors", "learners"):
            continue
        origin = Path(spec.origin).resolve()
        where = origin.parent if origin.name == "__init__.py" else origin
        if not any(where.is_relative_to(p) for p in installed) and str(where) not in out:
            out.append(str(where))
    return out


def summary(rows: Sequence[dict], names: Sequence[str], window: int = 3) -> str:
    """Each reward's mean over the first and the last ``window`` steps."""
    import numpy as np

    lines = [f"{'reward':<12} {'first':>7} {'last':>7}"]
    for name in names:
        values = [r.get(f"rewards/{name}/mean", float("nan")) for r in rows]
        lines.append(f"{name:<12} {np.nanmean(values[:window]):>7.3f} {np.nanmean(values[-window:]):>7.3f}")
    return "\n".join(lines)
