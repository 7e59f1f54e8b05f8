"""``gdpo-ray train``: a preset and overrides -> a validated GDPOConfig -> Ray -> the training loop
with a progress bar, metrics (JSONL + TensorBoard), checkpoints, the final policy as a Hugging
Face directory and a PNG of the reward curves, all under one run directory.

Ray (``gdpo_ray.run.cluster``): inside ``ray job submit`` (``RAY_ADDRESS`` set) or with
``run.address`` the run joins that cluster; otherwise it starts a local Ray with ``run.num_cpus``
logical CPUs, from the command line in the background while the run is checked.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

RUN_DEFAULTS = {"steps": 40, "output_dir": "runs", "num_cpus": 4, "address": None, "name": None,
                "checkpoint_at_end": True, "export_policy": True, "loggers": ["tensorboard", "jsonl"]}
RUN_KINDS = {"steps": int, "output_dir": str, "num_cpus": int, "address": (str, type(None)),
             "name": (str, type(None)), "checkpoint_at_end": bool, "export_policy": bool,
             "loggers": (list, str)}


def run_settings(sections: dict) -> dict:
    """The ``run`` section with its defaults, checked (names, kinds, ``run.name`` a plain folder
    name, the loggers' servers answering), before Ray starts."""
    from gdpo_ray.config import check_run_name, unknown_key
    from gdpo_ray.run.loggers import check_loggers

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
    check_run_name(run["name"], run["output_dir"])
    if run["steps"] < 1:
        raise ValueError(f"run.steps must be an integer >= 1; got {run['steps']!r}")
    if run["num_cpus"] < 1:  # a local Ray without CPUs holds no actor: the run would wait forever
        raise ValueError(f"run.num_cpus must be an integer >= 1 (the logical CPUs of the local Ray "
                         f"the run starts); got {run['num_cpus']!r}")
    run["loggers"] = check_loggers(run["loggers"])  # last: it may ask a server (a few seconds at most)
    return run


def in_temporary_working_dir(path: Path) -> bool:
    """Inside Ray's copy of a job's working dir (deleted with the job's files)."""
    return "runtime_resources" in path.parts and any(p.startswith("session_") for p in path.parts)


class Interrupted(BaseException):
    """SIGINT or SIGTERM that stops a run at once (a ``BaseException``, like KeyboardInterrupt:
    no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM while a run is up. While it trains (``soft``), the first
    one asks it to stop after the step in progress (``received``); a second one, or one before
    training starts, stops it at once (``Interrupted``). ``restore`` puts back the handlers that
    were there before; ``install`` again after ``ray.init``, which sets a SIGTERM handler of its
    own. Python runs handlers in the main thread only: elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self.soft = False
        self._before: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._before.setdefault(sig, signal.signal(sig, self._handle))

    def restore(self) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        self._before = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.soft or self.received is not None:
            raise Interrupted(signum)
        self.received = signum
        name = signal.Signals(signum).name
        print(f"\ngdpo-ray: {name} received: stopping after the step in progress, with a checkpoint "
              f"of it ({name} again stops at once, without one)", file=sys.stderr, flush=True)


class TrainingRun:
    def __init__(self, config: Any, run: dict, preset: str, resume: str | None = None,
                 continuing: Path | None = None, overrides: Sequence[str] = ()) -> None:
        from gdpo_ray.run.outputs import OutputDir

        self.config, self.run_settings, self.preset, self.resume = config, run, preset, resume
        self.overrides = list(overrides)  # as typed: the resume command repeats them
        self.changes: list = []  # settings that differ from the resumed checkpoint's
        self.warnings: list[str] = []
        self.outputs = OutputDir(run["output_dir"], run["name"], Path(preset).stem, continuing)
        self.run_dir = self.outputs.local
        self.ray = None  # a local Ray starting in the background (from_args), until run() uses it

    @classmethod
    def from_args(cls, config: str | None, overrides: Sequence[str] = (), resume: str | None = None,
                  ray_in_background: bool = False):
        """A run from the command line. ``resume``: a checkpoint, or a run directory (its latest
        complete checkpoint); the run goes on in that checkpoint's run directory, appending to
        its metrics, unless ``run.name`` names another directory (a new run from that state).
        The checkpoint is verified here (every file against its manifest), before any actor.
        ``ray_in_background``: a local Ray starts as soon as the ``run`` section is read, while
        the rest is checked (``gdpo_ray.run.cluster``); ``run()`` waits for it, or stops it when
        the run fails before its actors (as does a failure here)."""
        from gdpo_ray.run import cluster
        from gdpo_ray.run.presets import load_preset

        if config is not None and "=" in config:  # `gdpo-ray train training.lr=1e-4`
            config, overrides = None, [config, *overrides]
        sections = load_preset(config, overrides)
        run = run_settings(sections)
        ray = cluster.begin(run) if ray_in_background else None
        try:
            self = cls._checked(config, overrides, resume, sections, run)
        except BaseException:
            if ray is not None:
                ray.stop()
            raise
        self.ray = ray
        return self

    @classmethod
    def _checked(cls, config, overrides, resume, sections: dict, run: dict):
        """The run of these sections: RLlib's config of them, validated, and the checkpoint it
        resumes from, verified (its files against its manifest, its model against
        ``llm.model_path``)."""
        from gdpo_ray.run.algorithm import GDPOConfig
        from gdpo_ray.run.checkpoints import check_model, resume_changes, verify_checkpoint
        from gdpo_ray.run.presets import apply_sections

        gdpo = apply_sections(GDPOConfig(), sections)
        continuing = None
        if resume:  # relative to where the command runs, as the user typed it
            resume, continuing = resume_target(Path(resume).expanduser().resolve(), run, gdpo.checkpoint_dir)
        self = cls(gdpo, run, config or "demo", resume, continuing, overrides)
        if gdpo.checkpoint_dir is None:
            gdpo.checkpoint_dir = str(self.run_dir / "checkpoints")
        gdpo.validate()
        if resume:
            self.warnings = verify_checkpoint(resume, without_manifest=gdpo.resume_without_manifest)
            self.changes = resume_changes(gdpo, resume)
            self.warnings += check_model(gdpo, resume)
        return self

    def check(self, out=print):
        """The start-up checks (``gdpo_ray.run.preflight``): model, dataset, rewards on sample rows."""
        from gdpo_ray.run.preflight import preflight

        report = preflight(self.config)
        out(f"gdpo-ray: start-up check passed: {report.rows} dataset rows, rewards "
            f"{', '.join(report.names)} scored on sample rows")
        for note in report.notes:
            out(f"gdpo-ray: note: {note}")
        for warning in report.warnings:
            out(f"gdpo-ray: warning: {warning}")
        return report

    def _start_ray(self) -> None:
        """Ray up for the actors: the one started in the background, once it is up, else
        ``start_ray``'s (the cluster at ``run.address``, the job's, or a local one)."""
        from gdpo_ray.run.cluster import start_ray, user_modules

        ray, self.ray = self.ray, None  # from here on the run's, as if started here
        if ray is not None:
            ray.wait()
            return
        address = self.run_settings["address"]
        start_ray(address, self.run_settings["num_cpus"], user_modules(self.config) if address else [])

    def _final_eval(self, algo: Any) -> None:
        """With an eval suite: the final policy's report in the run's eval/ (the last scheduled
        eval when it was of this version, else one now), for ``gdpo-ray eval --compare``."""
        from gdpo_ray.eval.report import format_report, report_path, write_report
        from gdpo_ray.run.checkpoints import WriteFailed

        if algo.eval_suite is None:
            return
        report = algo.last_eval
        if report is None or report.get("step") != algo.policy_version:
            report = algo.evaluate_policy()
        if report is not None:
            report["policy"] = str(self.run_dir / "policy")
            path = report_path(self.run_dir, report["suite"])
            try:
                path = write_report(report, path)
            except OSError as err:
                raise WriteFailed("eval report", path, err) from None
            print(format_report(report))
            print(f"gdpo-ray: eval report {path}")

    def resume_command(self) -> str:
        """The command that continues this run in its directory (from its latest checkpoint)."""
        import shlex

        return shlex.join(["gdpo-ray", "train", self.preset, *self.overrides, "--resume", str(self.run_dir)])

    def last_checkpoint(self) -> str | None:
        """The latest complete checkpoint of this run (its own, or the one it resumed from)."""
        from gdpo_ray.run.checkpoints import checkpoint_version, latest_checkpoint

        found = latest_checkpoint(self.run_dir / "checkpoints", self.config.checkpoint_dir)
        resumed = checkpoint_version(self.resume) if self.resume else None
        if resumed is not None and (found is None or checkpoint_version(found) < resumed):
            return self.resume
        return found

    def where_to_resume(self) -> list[str]:
        """The lines that say from which checkpoint, and with which command, the run resumes."""
        last = self.last_checkpoint()
        if last is None:
            return ["gdpo-ray: no checkpoint was written: nothing to resume from"]
        if Path(last).parent in (self.run_dir / "checkpoints", Path(self.config.checkpoint_dir)):
            command = self.resume_command()
        else:  # the checkpoint this run resumed from, outside its directory: a new run from it
            command = self.resume_command().rpartition(" --resume ")[0]
            command += f" --resume {last} run.name=<new name>"
        return [f"gdpo-ray: last complete checkpoint {last}", f"gdpo-ray: resume with: {command}"]

    def run(self) -> int:
        """The run, start to end. Exit codes: 0 done, 1 stopped by a failure (a file that
        cannot be written), 128 + the signal when SIGINT (130) or SIGTERM (143) stopped it."""
        stop = StopSignals()
        stop.install()
        try:
            self.check()  # before the run directory or any actor
            if in_temporary_working_dir(self.run_dir):
                print(f"gdpo-ray: warning: outputs go to {self.run_dir}, inside Ray's temporary copy "
                      f"of the job's working dir, which Ray deletes; set run.output_dir to a shared "
                      f"path (run.output_dir=/mnt/shared/runs) or to storage (s3://bucket/runs)",
                      file=sys.stderr, flush=True)
            self.outputs.create()  # taken atomically: a second run of this name is refused here
            try:
                return self._train(stop)
            finally:
                if self.outputs.discard_if_empty():
                    print(f"gdpo-ray: no step was completed: run directory {self.outputs} removed",
                          file=sys.stderr, flush=True)
                self.outputs.release()
        except Interrupted as err:
            print(f"gdpo-ray train: stopped by {signal.Signals(err.signum).name}"
                  + ("" if stop.soft else " before the first step"), file=sys.stderr, flush=True)
            return 128 + err.signum
        finally:
            stop.restore()
            if self.ray is not None:  # failed before its actors: the Ray it was starting goes too
                self.ray.stop()

    def _train(self, stop: StopSignals) -> int:
        from gdpo_ray.run.checkpoints import WriteFailed
        from gdpo_ray.run.loggers import RunLog
        from gdpo_ray.run.outputs import latest_rows, plot_rewards, read_metrics

        print(f"gdpo-ray: run directory {self.outputs}", flush=True)
        self._save_config()
        if self.resume:
            print(f"gdpo-ray: resuming from {self.resume}"
                  + (" (continuing the run in its directory)" if self.outputs.continuing else ""), flush=True)
        for warning in self.warnings:
            print(f"gdpo-ray: warning: {warning}", file=sys.stderr, flush=True)
        self._start_ray()
        stop.install()  # ray.init set a SIGTERM handler of its own
        algo = log = None
        names: list[str] = []
        rows: list = []
        code, closing = 0, []  # closing: how the run stopped and how to resume it, said last
        try:
            algo = self.config.build_algo()
            if self.resume:  # this run's config, the checkpoint's state (weights, optimizer, prompts)
                for name, old, new in self.changes:
                    print(f"gdpo-ray: resuming with {name} {old!r} -> {new!r}")
                algo.restore_from_path(self.resume, verified=True)  # in from_args
            names = algo.reward_names
            log = RunLog(self.run_dir, self.run_settings["loggers"], self.outputs.name, self.sections)
            stop.soft = True  # from now on a signal stops the run after a step, with a checkpoint
            self._loop(algo, log, stop)
            if stop.received is not None:
                code, closing = 128 + stop.received, self._save_on_signal(algo, stop.received)
            else:
                self._finish(algo, stop)
                if stop.received is not None:  # during the final checkpoint, export or eval
                    code, closing = 128 + stop.received, self.where_to_resume()
        except Interrupted as err:  # a second signal: no checkpoint of the step in progress
            closing = [f"gdpo-ray train: stopped at once by {signal.Signals(err.signum).name}",
                       *self.where_to_resume()]
            code = 128 + err.signum
        except WriteFailed as err:  # a full disk: the run cannot go on without its record
            closing = [f"gdpo-ray train: stopped: {err}; a run that cannot write its metrics or "
                       f"checkpoints stops rather than train on without them", *self.where_to_resume()]
            code = 1
        finally:
            if log is not None:
                log.close(failed=code == 1 or sys.exc_info()[0] is not None)
            if algo is not None:
                algo.stop()
            rows = read_metrics(self.run_dir / "metrics.jsonl") or (log.rows if log is not None else [])
            if rows:
                try:
                    plot_rewards(rows, names, self.run_dir / "rewards.png")
                except OSError as err:
                    print(f"gdpo-ray: warning: cannot write the plot {self.run_dir / 'rewards.png'}: "
                          f"{err.strerror or err}", file=sys.stderr)
            self.outputs.upload()
        if rows:
            print(summary(latest_rows(rows), names))
        print(f"gdpo-ray: {', '.join(self.written())}")
        print(f"gdpo-ray: run directory {self.outputs}", flush=True)
        for line in closing:
            print(line, file=sys.stderr, flush=True)
        return code

    def _save_config(self) -> None:
        """The resolved config, once, as ``config.yaml`` (a preset: ``gdpo-ray train`` runs it)."""
        import yaml

        from gdpo_ray.run.checkpoints import WriteFailed

        path = self.run_dir / "config.yaml"
        try:
            path.write_text(yaml.safe_dump(self.sections, sort_keys=False))
        except OSError as err:
            raise WriteFailed("config", path, err) from None

    @property
    def sections(self) -> dict:
        from gdpo_ray.run.presets import resolved_sections

        sections = resolved_sections(self.config, self.run_settings)
        if sections["training"]["checkpoint_dir"] == str(self.run_dir / "checkpoints"):
            sections["training"]["checkpoint_dir"] = None  # this run's own: another run gets its own
        return sections

    def written(self) -> list[str]:
        """Where the run's metrics went, logger by logger, and its plot."""
        from gdpo_ray.run.loggers import mlflow_uri

        where = {"jsonl": f"metrics {self.outputs / 'metrics.jsonl'}",
                 "tensorboard": f"TensorBoard {self.outputs / 'tensorboard'}",
                 "wandb": f"wandb {self.outputs / 'wandb'}", "mlflow": f"MLflow {mlflow_uri(str(self.outputs))}"}
        return [where[n] for n in self.run_settings["loggers"]] + [f"plot {self.outputs / 'rewards.png'}"]

    def _loop(self, algo: Any, log: Any, stop: StopSignals) -> None:
        """Steps until ``run.steps`` or a signal. A step in which a learner died is redone by the
        algorithm from its last checkpoint (or the start), with the steps between, within the same
        ``train()``: each step is logged once, and the recovery said once here."""
        from tqdm import tqdm

        from gdpo_ray.run.outputs import flat_scalars

        steps, names = self.run_settings["steps"], algo.reward_names
        estimator = getattr(getattr(algo, "config", None), "estimator", "gdpo")
        bar = tqdm(total=steps, initial=algo.policy_version, desc=estimator, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
        placed = None  # (actors, nodes) of the rollout group: elastic runs change it
        try:
            while algo.policy_version < steps and stop.received is None:
                recoveries = algo.counters["learner_recoveries"]
                scalars = flat_scalars(algo.train())
                if algo.counters["learner_recoveries"] != recoveries:
                    failed, restored = algo.last_recovery
                    redone = (f"step {failed}" if restored + 1 == failed else f"steps {restored + 1}-{failed}")
                    bar.write(f"gdpo-ray: a learner died in step {failed}; new learners took over from "
                              f"step {restored} (the last checkpoint, or the start) and redid {redone}",
                              file=sys.stderr)
                log.log(algo.policy_version, scalars)
                log.log_completions(algo.policy_version, getattr(algo, "last_completions", ()))
                now = (_count(scalars, "rollout/actors"), _count(scalars, "rollout/nodes"))
                if None not in now and now != placed:
                    bar.write(f"gdpo-ray: rollout actors {now[0]} on {now[1]} node(s)")
                    placed = now
                bar.set_postfix({n: f"{scalars.get(f'rewards/{n}/mean', float('nan')):.2f}" for n in names})
                bar.n = algo.policy_version
                bar.refresh()
        finally:
            bar.close()

    def _save_on_signal(self, algo: Any, signum: int) -> list[str]:
        """A checkpoint of the last completed step (whatever ``checkpoint_every`` says; the
        automatic one of that step when there is one), its path and the resume command."""
        from gdpo_ray.run.checkpoints import checkpoint_version

        path = self.run_dir / "checkpoints" / f"step_{algo.policy_version:06d}"
        if checkpoint_version(path) != algo.policy_version:
            path = algo.save_to_path(str(path))
        return [f"gdpo-ray train: stopped by {signal.Signals(signum).name} after step "
                f"{algo.policy_version}; checkpoint {path}",
                f"gdpo-ray: resume with: {self.resume_command()}"]

    def _finish(self, algo: Any, stop: StopSignals) -> None:
        """The final checkpoint, then (unless a signal came meanwhile) the policy in Hugging
        Face format and the final eval."""
        from gdpo_ray.run.checkpoints import WriteFailed

        if self.run_settings["checkpoint_at_end"]:
            print(f"gdpo-ray: checkpoint {algo.save_to_path(str(self.run_dir / 'checkpoints' / 'final'))}")
        if stop.received is not None:
            return
        if self.run_settings["export_policy"]:
            try:
                policy = algo.export_policy(str(self.run_dir / "policy"))
            except OSError as err:  # a learner's, raised on its actor
                raise WriteFailed("policy", self.run_dir / "policy", err) from None
            if Path(f"{policy}-merged").is_dir():  # LoRA: the adapter, and merged into the base
                print(f"gdpo-ray: policy (a PEFT LoRA adapter) {policy}, merged into the base model "
                      f"(Hugging Face format) {policy}-merged")
            else:
                print(f"gdpo-ray: policy (Hugging Face format) {policy}")
        if stop.received is None:
            self._final_eval(algo)


def _count(scalars: dict, key: str) -> int | None:
    """A count among the metrics, None when missing or not finite (a step that failed)."""
    value = scalars.get(key, 0.0)
    return int(value) if math.isfinite(value) else None


def resume_target(given: Path, run: dict, checkpoint_dir: str | None) -> tuple[str, Path | None]:
    """``--resume``'s checkpoint (``given`` itself, or a run directory's latest complete one)
    and the run directory to continue in: the checkpoint's own, unless ``run.name`` names
    another (then None: a new run from that state). Refused (ValueError): a path that is
    neither, a run directory without a checkpoint, and going on in a run directory from a
    checkpoint older than its latest (two histories in one directory)."""
    from gdpo_ray.run.checkpoints import checkpoint_version, latest_checkpoint
    from gdpo_ray.run.outputs import checkpoint_run_dir, is_run_dir

    if not given.is_dir():
        raise ValueError(f"--resume {given}: no such checkpoint or run directory")
    checkpoint, run_dir = str(given), checkpoint_run_dir(given)
    if is_run_dir(given) or (given / "checkpoints").is_dir():  # a run directory
        run_dir, checkpoint = given, latest_checkpoint(given / "checkpoints", checkpoint_dir)
        if checkpoint is None:
            raise ValueError(f"--resume {given}: the run directory holds no complete checkpoint "
                             f"(it stopped before its first one): nothing to resume from; start "
                             f"the run again under a new run.name")
    storage = "://" in run["output_dir"]
    named = run["name"] and not storage and Path(run["output_dir"]).expanduser().resolve() / run["name"]
    if run_dir is None or storage or (named and named != run_dir):
        return checkpoint, None  # a new run directory
    latest = latest_checkpoint(run_dir / "checkpoints", checkpoint_dir)
    if latest is not None and checkpoint_version(latest) > (checkpoint_version(checkpoint) or 0):
        raise ValueError(f"--resume {given}: run directory {run_dir} went on past this checkpoint "
                         f"(to {latest}); going on from here in it would mix two histories: add "
                         f"run.name=<new name> to start a new run from this checkpoint, or resume "
                         f"the run's latest with --resume {run_dir}")
    return checkpoint, run_dir


def summary(rows: Sequence[dict], names: Sequence[str], window: int = 3) -> str:
    """Each reward's batch mean over the first and the last ``window`` steps, the windows named."""
    import warnings

    import numpy as np

    steps = [int(r["step"]) for r in rows]
    window = max(1, min(window, len(steps) // 2))  # two windows apart (one step: the same)
    first, last = steps[:window], steps[-window:]
    span = lambda s: f"step {s[0]}" if len(s) == 1 else f"steps {s[0]}-{s[-1]}"
    width = max(len(span(first)), len(span(last)), 7)
    first_width = max([12, *(len(n) for n in names)])  # a judge's columns are long: quality/helpful
    lines = ["batch mean of each reward", f"{'reward':<{first_width}} {span(first):>{width}} {span(last):>{width}}"]
    with warnings.catch_warnings():  # all NaN (a reward that never computed): nan, no warning
        warnings.simplefilter("ignore", RuntimeWarning)
        for name in names:
            values = [r.get(f"rewards/{name}/mean", float("nan")) for r in rows]
            lines.append(f"{name:<{first_width}} {np.nanmean(values[:window]):>{width}.3f} "
                         f"{np.nanmean(values[-window:]):>{width}.3f}")
    return "\n".join(lines)
