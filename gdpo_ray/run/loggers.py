"""Where a run's metrics go (``run.loggers``): any of ``tensorboard``, ``jsonl`` (the default:
both), ``wandb`` and ``mlflow``, each through its library's own client. The run's resolved
config goes to each once (metrics.jsonl holds metrics only: the config is ``config.yaml`` in the
run directory); with ``training.log_completions`` each step's samples go to ``completions.jsonl``
and, where those loggers are on, to a TensorBoard text table, a wandb table and an MLflow table.

    jsonl        <run_dir>/metrics.jsonl (one JSON object per step), <run_dir>/completions.jsonl
    tensorboard  <run_dir>/tensorboard/ (scalars; the config and the samples as text)
    wandb        a wandb run named after the run (project: $WANDB_PROJECT or gdpo-ray), files in
                 <run_dir>/wandb; offline (``wandb sync`` uploads it later) unless $WANDB_MODE
                 says otherwise or an API key is set ($WANDB_API_KEY, or ``wandb login``)
    mlflow       an MLflow run named after the run in experiment $MLFLOW_EXPERIMENT_NAME (or
                 gdpo-ray), at $MLFLOW_TRACKING_URI or else ``file:<run_dir>/mlruns``

A run directory opened again (``gdpo-ray train --resume RUN_DIR`` continues in it) continues the
same wandb and MLflow runs: their ids are kept in ``<run_dir>/logger_runs.json`` (``RunIds``).

Writes are synchronous: a write that fails raises ``WriteFailed`` naming the file, at that step.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from gdpo_ray.kept_out import kept_out
from gdpo_ray.run.checkpoints import WriteFailed

LOGGERS = ("tensorboard", "jsonl", "wandb", "mlflow")
DEFAULT_LOGGERS = ["tensorboard", "jsonl"]
#: the package each logger needs, and how to get it
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
#: metrics logged on some steps only (training.eval_every)
SOME_STEPS = ("eval/", "timing/eval_s")
#: RLlib's bookkeeping in every result: its config (saved once as config.yaml instead), its own
#: timers and counters, which repeat ours (step, time, timing/step_s) under other names
RLLIB_KEYS = ("config/", "timers/", "num_training_step_calls_per_iteration", "num_env_steps_sampled_lifetime",
              "training_iteration", "timestamp", "time_this_iter_s", "time_total_s", "pid",
              "time_since_restore", "iterations_since_restore")


def check_loggers(value: Any) -> list[str]:
    """``run.loggers`` checked before anything starts (Ray included): known names, their packages
    installed, and the servers they log to answering (``check_servers``)."""
    import importlib.util

    from gdpo_ray.config import unknown_key

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"run.loggers must be a list of names from {list(LOGGERS)}; got {value!r}")
    for name in value:
        if name not in LOGGERS:
            raise ValueError(unknown_key(name, list(LOGGERS), "run.loggers").replace("a setting of", "a logger of"))
        module, package = PACKAGES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            raise ValueError(f"run.loggers: {name} needs the {package} package: pip install {package} "
                             f"(or leave {name} out of run.loggers)")
    names = list(dict.fromkeys(value))
    check_servers(names, PROBE_TIMEOUT_S)
    return names


#: seconds a logger's server has to answer before the run starts (``check_servers``)
PROBE_TIMEOUT_S = 5.0
#: a gateway's answer that no server is behind it (which MLflow's client retries for minutes)
_NO_SERVER = (502, 503, 504)


def check_servers(loggers: Sequence[str], timeout: float = PROBE_TIMEOUT_S) -> None:
    """The servers the loggers write to answer within ``timeout`` seconds, checked before Ray
    starts (else MLflow's client retries for minutes, after the actors started, then fails):

    - mlflow: ``$MLFLOW_TRACKING_URI`` when it is http(s), asked what its client asks first (the
      experiment by name) and answering as an MLflow server does (the experiment, its absence,
      or a login required); unset, ``file:`` or a local path (and MLflow's database and
      Databricks stores) need no probe;
    - wandb: when it logs online (``_wandb_mode``), ``$WANDB_BASE_URL`` (default
      https://api.wandb.ai) answering at all; offline needs no network.

    No answer (refused, unresolvable, silent) or a gateway's 502/503/504 (no server behind it)
    is a ValueError naming the setting, the URI and the fix."""
    if "mlflow" in loggers:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        failed = _mlflow_answer(uri, timeout) if _is_http(uri) else None
        if failed:
            raise ValueError(
                f"run.loggers: mlflow logs to MLFLOW_TRACKING_URI={_without_credentials(uri)}, which "
                f"{failed}; start the tracking server (mlflow server --host 127.0.0.1 --port 5000) or correct "
                f"MLFLOW_TRACKING_URI, unset it to log into the run directory (file:<run_dir>/mlruns), "
                f"or leave mlflow out of run.loggers")
    if "wandb" in loggers and _wandb_mode() == "online":
        uri = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
        answer = _probe(uri, timeout)
        failed = answer if isinstance(answer, str) else _gateway(answer[0])
        if failed:
            raise ValueError(
                f"run.loggers: wandb logs online (an API key is set, or WANDB_MODE=online) to "
                f"{_without_credentials(uri)}, which {failed}; check the network (or WANDB_BASE_URL), log "
                f"offline with WANDB_MODE=offline (wandb sync uploads the run later), or leave wandb out of "
                f"run.loggers")


def _mlflow_answer(uri: str, timeout: float) -> str | None:
    """None when the tracking server at ``uri`` answers its client's first request (the run's
    experiment by name) as MLflow does: 200, 404 RESOURCE_DOES_NOT_EXIST (none yet: the run
    creates it), or 401/403 (the client logs in: $MLFLOW_TRACKING_TOKEN, ..._USERNAME); else
    what it did."""
    from urllib.parse import quote

    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "gdpo-ray")
    path = f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={quote(name)}"
    answer = _probe(uri.rstrip("/") + path, timeout)
    if isinstance(answer, str):
        return answer
    status, body = answer
    if status in (200, 401, 403) or (status == 404 and b"RESOURCE_DOES_NOT_EXIST" in body):
        return None
    return _gateway(status) or (f"answered HTTP {status} at {path.split('?')[0]}, as no MLflow tracking "
                                f"server does (another service at that address?)")


def _gateway(status: int) -> str | None:
    return f"answered HTTP {status} (a gateway with no server behind it)" if status in _NO_SERVER else None


def _is_http(uri: str) -> bool:
    from urllib.parse import urlsplit

    return urlsplit(uri).scheme.lower() in ("http", "https")


def _without_credentials(uri: str) -> str:
    """``uri`` without a ``user:password@`` part (a probe does not log in; an error does not show it)."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _probe(url: str, timeout: float) -> tuple[int, bytes] | str:
    """(HTTP status, the body's first KiB) of a GET of ``url`` answered within ``timeout``
    seconds, else what happened ("cannot be reached (...)", "did not answer within 5 s"). The
    whole probe, name resolution included, is bounded: it runs on a thread, left behind if it
    hangs. Proxies are the environment's (``HTTPS_PROXY``, ``NO_PROXY``), as the clients' are;
    certificates are not checked (reachability only)."""
    import ssl
    import threading
    import urllib.error
    import urllib.request

    outcome: list[tuple[int, bytes] | str] = []
    silent = f"did not answer within {timeout:g} s"

    def request() -> None:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        probe = urllib.request.Request(_without_credentials(url), headers={"User-Agent": "gdpo-ray"})
        try:
            with urllib.request.urlopen(probe, timeout=timeout, context=context) as answer:
                outcome.append((answer.status, answer.read(1024)))
        except urllib.error.HTTPError as err:  # an answer, with an error status
            outcome.append((err.code, err.read(1024) if err.fp is not None else b""))
        except urllib.error.URLError as err:
            timed_out = isinstance(err.reason, TimeoutError)
            outcome.append(silent if timed_out else f"cannot be reached ({err.reason})")
        except TimeoutError:  # connected, then no answer
            outcome.append(silent)
        except (OSError, ValueError) as err:  # a connection reset, a malformed URI
            outcome.append(f"cannot be reached ({err})")

    thread = threading.Thread(target=request, name="gdpo-ray-logger-probe", daemon=True)
    thread.start()
    thread.join(timeout + 1)
    return outcome[0] if outcome else silent


def run_metrics(scalars: Mapping[str, float]) -> dict[str, float]:
    """A step's metrics: RLlib's bookkeeping left out, and the evals' NaN on the steps between."""
    return {k: v for k, v in scalars.items()
            if not k.startswith(RLLIB_KEYS) and not (k.startswith(SOME_STEPS) and math.isnan(v))}


def flat_config(sections: Mapping[str, Any]) -> dict[str, str]:
    """``{"training.lr": "1e-06", ...}``: the resolved config as one level of text values."""
    out = {}
    for section, values in sections.items():
        for key, value in (values or {}).items():
            out[f"{section}.{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


class RunLog:
    """The run's loggers. ``rows``: every row logged, in order (the end-of-run table and plot)."""

    def __init__(self, run_dir: str | Path, loggers: Sequence[str] = DEFAULT_LOGGERS, name: str | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        self.run_dir, self.rows = Path(run_dir), []
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteFailed("run directory", self.run_dir, err) from None
        kinds = {"jsonl": JsonlLog, "tensorboard": TensorBoardLog, "wandb": WandbLog, "mlflow": MlflowLog}
        self.backends: list = []
        try:
            for logger in loggers:
                self.backends.append(kinds[logger](self.run_dir, name or self.run_dir.name, config or {}))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        scalars = {k: v for k, v in run_metrics(scalars).items() if k not in ("step", "time")}
        # "time": the wall clock (Unix seconds) when the step ended
        row = {"step": step, "time": round(time.time(), 3)} | scalars
        self.rows.append(row)
        for backend in self.backends:
            backend.log(step, row)

    def log_completions(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """One step's samples (``training.log_completions``): dicts of prompt, completion,
        rewards, advantage, finish reason."""
        if samples:
            for backend in self.backends:
                backend.log_completions(step, [{"step": step, **s} for s in samples])

    def close(self, failed: bool = False) -> None:
        """Closes every logger (a failure to write was raised by ``log`` already)."""
        for backend in self.backends:
            try:
                backend.close(failed)
            except Exception:  # noqa: BLE001 - a logger that cannot close loses nothing logged
                pass


class RunIds:
    """``<run_dir>/logger_runs.json``: the wandb and MLflow runs a run directory logs into, one
    entry per logger (``{"wandb": {"id", "project"}, "mlflow": {"tracking_uri", "run_id"}}``),
    so that a resumed run continues them rather than starting second ones."""

    FILE = "logger_runs.json"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / self.FILE

    def get(self, logger: str) -> dict:
        try:
            entry = json.loads(self.path.read_text()).get(logger)
        except (OSError, ValueError, AttributeError):  # none yet, or not ours to read
            return {}
        return entry if isinstance(entry, dict) else {}

    def put(self, logger: str, entry: Mapping[str, str]) -> None:
        try:
            known = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except ValueError:
            known = {}
        known = known if isinstance(known, dict) else {}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(known | {logger: dict(entry)}, indent=1) + "\n")
            tmp.replace(self.path)  # atomic: the other logger's entry is never half written
        except OSError as err:
            raise WriteFailed("logger run ids", self.path, err) from None


def _table_columns(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for s in samples for k in s))


class JsonlLog:
    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        self.path, self.samples_path, self._samples = run_dir / "metrics.jsonl", run_dir / "completions.jsonl", None
        try:
            self._file = self.path.open("a")
        except OSError as err:
            raise WriteFailed("metrics", self.path, err) from None

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self._write(self._file, self.path, "metrics", [row])

    def log_completions(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        if self._samples is None:
            try:
                self._samples = self.samples_path.open("a")
            except OSError as err:
                raise WriteFailed("completions", self.samples_path, err) from None
        self._write(self._samples, self.samples_path, "completions", samples)

    @staticmethod
    def _write(file, path: Path, what: str, rows: Sequence[Mapping[str, Any]]) -> None:
        try:
            file.write("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
            file.flush()
        except OSError as err:
            raise WriteFailed(what, path, err) from None

    def close(self, failed: bool) -> None:
        for file in (self._file, self._samples):
            if file is not None:
                file.close()


class TensorBoardLog:
    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        with kept_out("torch"):  # tensorboardX takes torch tensors too; these are floats and text
            from tensorboardX.event_file_writer import EventsWriter

        folder = run_dir / "tensorboard"
        try:
            folder.mkdir(exist_ok=True)
            self._tb = EventsWriter(str(folder / "events"))
        except OSError as err:
            raise WriteFailed("TensorBoard events", folder, err) from None
        if config:  # once, as text: TensorBoard's Text tab
            text = "\n".join(f"    {k}: {v}" for k, v in flat_config(config).items())
            self._write(0, [self._text("config", text)])

    @staticmethod
    def _text(tag: str, text: str):
        from tensorboardX.summary import text as text_summary

        return text_summary(tag, text).value[0]

    def _write(self, step: int, values: list) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        try:
            self._tb.write_event(event_pb2.Event(wall_time=time.time(), step=step,
                                                 summary=summary_pb2.Summary(value=values)))
            self._tb.flush()
        except OSError as err:
            raise WriteFailed("TensorBoard events", self._tb._file_name, err) from None

    def log(self, step: int, row: Mapping[str, float]) -> None:
        from tensorboardX.proto import summary_pb2

        self._write(step, [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in row.items()
                           if k not in ("step", "time") and math.isfinite(v)])

    def log_completions(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        columns = _table_columns(samples)  # a markdown table: TensorBoard renders it in its Text tab
        cell = lambda v: str(v if not isinstance(v, float) else round(v, 4)).replace("|", "\\|").replace("\n", "<br>")
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(s.get(c, "")) for c in columns) + " |" for s in samples]
        self._write(step, [self._text("completions", "\n".join(lines))])

    def close(self, failed: bool) -> None:
        self._tb.close()


def _wandb_mode() -> str:
    """$WANDB_MODE, else online with an API key ($WANDB_API_KEY or ``wandb login``'s netrc entry),
    else offline: a run never stops at a login prompt."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc

    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class WandbLog:
    """A wandb run; the run directory's (``RunIds``) when it has one: a resumed run continues it
    (``resume="allow"``; offline, each resume writes an ``offline-run-*`` folder of the same id,
    which ``wandb sync`` uploads into that one run, in order). A setting the resume changed
    replaces the config's value; a step logged again keeps its first values (wandb takes each
    step once)."""

    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        self.mode = _wandb_mode()
        project = os.environ.get("WANDB_PROJECT", "gdpo-ray")
        ids = RunIds(run_dir)
        known = ids.get("wandb")
        resuming = known.get("project") == project and bool(known.get("id"))
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=self.mode,
                              id=known["id"] if resuming else None, resume="allow" if resuming else None,
                              config=dict(config), allow_val_change=resuming, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        if not resuming:
            ids.put("wandb", {"id": self.run.id, "project": project})
        self._columns: list[str] | None = None
        self._table = None

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log({k: v for k, v in row.items() if k not in ("step", "time")}, step=step)

    def log_completions(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        if self._columns is None:  # one table, growing each step (wandb's "incremental" table)
            self._columns = _table_columns(samples)
            self._table = self._wandb.Table(columns=self._columns, log_mode="INCREMENTAL")
        for s in samples:
            self._table.add_data(*[json.dumps(s[c]) if isinstance(s.get(c), (dict, list)) else s.get(c)
                                   for c in self._columns])
        self.run.log({"completions": self._table}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


#: what an MLflow metric name may hold; any other character becomes "_" (pass@4 -> pass_4)
_MLFLOW_NAME = re.compile(r"[^\w./\- ]")


def mlflow_uri(run_dir: str | Path) -> str:
    """Where a run's MLflow logger writes: $MLFLOW_TRACKING_URI, else its directory's file store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"file:{str(run_dir).rstrip('/')}/mlruns"


class MlflowLog:
    """An MLflow run; the run directory's (``RunIds``) when it has one at the same tracking URI
    and it still exists: a resumed run continues it (status RUNNING again, metrics appended). A
    setting the resume changed keeps its first value as the param (MLflow's params cannot
    change) and its new one as the tag ``resumed.<setting>``."""

    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        uri = mlflow_uri(run_dir)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # under the run's own bar
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless told; a run's local record
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # is exactly what it is for
        from mlflow.tracking import MlflowClient

        self.client, self.uri = MlflowClient(tracking_uri=uri), uri
        ids = RunIds(run_dir)
        logged = self._reopen(ids.get("mlflow"))
        if logged is None:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "gdpo-ray")
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(experiment_name))
            self.run_id, logged = self.client.create_run(experiment_id, run_name=name).info.run_id, {}
            ids.put("mlflow", {"tracking_uri": uri, "run_id": self.run_id})
        params = [(k[:250], v[:6000]) for k, v in flat_config(config).items()]
        for key, value in params:
            if key in logged and logged[key] != value:  # changed by the resume
                self.client.set_tag(self.run_id, f"resumed.{key}"[:250], value)
        params = [(k, v) for k, v in params if k not in logged]
        from mlflow.entities import Param

        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params[i:i + 100]])

    def _reopen(self, known: Mapping[str, str]) -> dict | None:
        """The params of the stored run, set RUNNING again; None when there is none to continue
        (none stored, another tracking URI, or the run deleted)."""
        if known.get("tracking_uri") != self.uri or not known.get("run_id"):
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(known["run_id"])
        except MlflowException:
            return None
        if run.info.lifecycle_stage != "active":
            return None
        self.run_id = run.info.run_id
        self.client.update_run(self.run_id, status="RUNNING")
        return dict(run.data.params)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(row.get("time", time.time()) * 1000)
        metrics = [Metric(_MLFLOW_NAME.sub("_", k), v, stamp, step) for k, v in row.items()
                   if k not in ("step", "time") and math.isfinite(v)]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_completions(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        import warnings

        columns = _table_columns(samples)
        table = {c: [json.dumps(s[c]) if isinstance(s.get(c), (dict, list)) else s.get(c) for s in samples]
                 for c in columns}
        with warnings.catch_warnings():  # MLflow's own use of pandas (select_dtypes), not ours to fix
            warnings.simplefilter("ignore")
            self.client.log_table(self.run_id, table, artifact_file="completions.json")  # appends

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
