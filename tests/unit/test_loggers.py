"""run.loggers: TensorBoard, JSONL, wandb (offline) and MLflow (a file: store), each through its
own client, read back through that library's own reader; the config logged once; metrics.jsonl
without RLlib's bookkeeping; training.log_completions' samples in every logger."""

from __future__ import annotations

import json
import math
import time

import pytest

from gdpo_ray.run.loggers import RunLog, check_loggers, flat_config, run_metrics

CONFIG = {"training": {"lr": 1e-5, "rewards": [{"name": "a", "fn": "regex"}]}, "run": {"steps": 2}}
RESULT = {"rewards/a/mean": 0.25, "eval/task/accuracy": float("nan"), "pass@4": 0.5,
          "config/lr": 1e-5, "timers/training_step": 1.0, "training_iteration": 1.0, "pid": 77.0,
          "time_this_iter_s": 1.0, "perf/cpu_util_percent": 50.0}
SAMPLES = [{"prompt": "2+2?", "completion": "<answer>4</answer>", "rewards/a": 1.0, "advantage": 0.5,
            "finish_reason": "stop"},
           {"prompt": "1|2", "completion": "x\ny", "rewards/a": float("nan"), "advantage": -0.5,
            "finish_reason": "length"}]


def test_a_step_keeps_its_metrics_and_drops_rllibs_bookkeeping():
    assert run_metrics(RESULT) == {"rewards/a/mean": 0.25, "pass@4": 0.5, "perf/cpu_util_percent": 50.0}


def test_the_config_is_flattened_to_text_values():
    assert flat_config(CONFIG) == {"training.lr": "1e-05", "training.rewards": '[{"name": "a", "fn": "regex"}]',
                                   "run.steps": "2"}


def test_loggers_are_checked_by_name_and_package(monkeypatch):
    assert check_loggers("wandb") == ["wandb"]
    assert check_loggers(["jsonl", "jsonl", "mlflow"]) == ["jsonl", "mlflow"]
    with pytest.raises(ValueError, match=r"'wandbb' is not a logger of run.loggers; did you mean 'wandb'"):
        check_loggers(["wandbb"])
    with pytest.raises(ValueError, match="run.loggers must be a list of names"):
        check_loggers({"wandb": True})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"mlflow needs the mlflow-skinny package: pip install mlflow-skinny"):
        check_loggers(["mlflow"])


def _log_two_steps(run_dir, loggers):
    log = RunLog(run_dir, loggers, "my-run", CONFIG)
    log.log(1, RESULT)
    log.log_completions(1, SAMPLES)
    log.log(2, {"rewards/a/mean": 0.75})
    log.log_completions(2, SAMPLES[:1])
    log.log_completions(3, [])  # a step without samples logs none
    log.close()
    return log


def test_jsonl_holds_metrics_and_completions_only(tmp_path):
    log = _log_two_steps(tmp_path, ["jsonl"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["pass@4", "perf/cpu_util_percent", "rewards/a/mean", "step", "time"],
                                         ["rewards/a/mean", "step", "time"]]
    assert [r["rewards/a/mean"] for r in rows] == [0.25, 0.75] and rows == log.rows
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert samples[0] == {"step": 1, **SAMPLES[0]}
    assert samples[1]["completion"] == "x\ny" and math.isnan(samples[1]["rewards/a"])
    assert [s["step"] for s in samples] == [1, 1, 2]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_holds_the_scalars_the_config_and_the_samples(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_two_steps(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("rewards/a/mean")] == [(1, 0.25), (2, 0.75)]
    assert "config/lr" not in events.Tags()["scalars"]
    texts = {tag: events.Tensors(tag) for tag in events.Tags()["tensors"]}
    config = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert "training.lr: 1e-05" in config and "run.steps: 2" in config
    table = texts["completions/text_summary"][0]
    assert table.step == 1
    lines = table.tensor_proto.string_val[0].decode().splitlines()
    assert lines[0] == "| step | prompt | completion | rewards/a | advantage | finish_reason |"
    assert lines[3] == "| 1 | 1\\|2 | x<br>y | nan | -0.5 | length |"
    assert not (tmp_path / "metrics.jsonl").exists()


def _wandb_records(raw: bytes):
    """The records of a wandb run file: a 7-byte header (":W&B", magic, version), then LevelDB's
    log format (32 KiB blocks of chunks: crc32c, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4)."""
    import struct

    assert raw[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:
            break
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pending
            pending = b""


def test_wandb_offline_run_holds_the_config_metrics_and_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_two_steps(tmp_path, ["wandb"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # the run file's records (what `wandb sync` uploads), parsed with wandb's own protobuf classes
    from wandb.proto import wandb_internal_pb2

    path = next(runs[0].glob("*.wandb"))
    for _ in range(150):  # wandb's service may still be writing when finish() returns: until its exit record
        records = []
        for data in _wandb_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.2)
    config, history = {}, []
    for record in records:
        if record.WhichOneof("record_type") in ("run", "config"):  # given at init: in the run record
            updates = (record.run.config if record.HasField("run") else record.config).update
            config |= {item.key: json.loads(item.value_json) for item in updates}
        elif record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    assert config["training"] == CONFIG["training"] and config["run"] == {"steps": 2}
    assert [(h["_step"], h["rewards/a/mean"]) for h in history] == [(1, 0.25), (2, 0.75)]
    assert "config/lr" not in history[0] and "pid" not in history[0]
    assert history[0]["completions/_type"] == "incremental-table-file" and history[0]["completions/nrows"] == 2
    table = json.loads((runs[0] / "files" / history[0]["completions/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "rewards/a", "advantage", "finish_reason"]
    assert table["data"][0] == [1, "2+2?", "<answer>4</answer>", 1.0, 0.5, "stop"]
    assert history[1]["completions/nrows"] == 3 and history[1]["completions/increment_num"] == 1


def test_mlflow_file_store_holds_the_params_metrics_and_table(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    _log_two_steps(tmp_path, ["mlflow"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    assert run.data.params == {"training.lr": "1e-05", "training.rewards": '[{"name": "a", "fn": "regex"}]',
                               "run.steps": "2"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rewards/a/mean")] == \
        [(1, 0.25), (2, 0.75)]
    assert "pass_4" in run.data.metrics and "pid" not in run.data.metrics
    table = json.loads((tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts"
                        / "completions.json").read_text())
    assert table["columns"] == ["step", "prompt", "completion", "rewards/a", "advantage", "finish_reason"]
    assert table["data"][0] == [1, "2+2?", "<answer>4</answer>", 1.0, 0.5, "stop"]
    assert [row[0] for row in table["data"]] == [1, 1, 2]  # each step's samples appended


def _wandb_run_files(run_dir):
    """{offline-run folder name: (its run id, [(step, rewards/a/mean), ...])} from each folder's
    run file, once wandb's service has written its exit record."""
    from wandb.proto import wandb_internal_pb2

    out = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        path = next(folder.glob("*.wandb"))
        for _ in range(150):
            records = [wandb_internal_pb2.Record.FromString(data) for data in _wandb_records(path.read_bytes())]
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                break
            time.sleep(0.2)
        run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
        history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                   for r in records if r.WhichOneof("record_type") == "history"]
        out[folder.name] = (run_id, [(h["_step"], h["rewards/a/mean"]) for h in history])
    return out


def test_a_resumed_run_directory_continues_its_wandb_run(tmp_path, monkeypatch):
    """`--resume RUN_DIR` opens the run directory's loggers again: one wandb run, not two. Offline,
    each opening writes a folder of the same run id, which `wandb sync` uploads into that run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_two_steps(tmp_path, ["wandb"])
    resumed = RunLog(tmp_path, ["wandb"], "my-run", {**CONFIG, "training": {"lr": 3e-5}})  # a changed setting
    resumed.log(3, {"rewards/a/mean": 1.0})
    resumed.close()
    stored = json.loads((tmp_path / "logger_runs.json").read_text())["wandb"]
    folders = _wandb_run_files(tmp_path)
    assert len(folders) == 2
    assert {run_id for run_id, _ in folders.values()} == {stored["id"]} and stored["project"] == "gdpo-ray"
    assert [h for _, history in folders.values() for h in history] == [(1, 0.25), (2, 0.75), (3, 1.0)]
    other = tmp_path / "other"  # another run directory: a run of its own
    RunLog(other, ["wandb"], "other", CONFIG).close()
    assert [run_id for run_id, _ in _wandb_run_files(other).values()] != [stored["id"]]


def test_a_resumed_run_directory_continues_its_mlflow_run(tmp_path, monkeypatch):
    """One MLflow run across a resume: metrics appended, status RUNNING then FINISHED again; a
    setting the resume changed keeps its first value as the param (MLflow's params cannot
    change) and its new one as a tag."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    from mlflow.tracking import MlflowClient

    _log_two_steps(tmp_path, ["mlflow"])
    changed = {**CONFIG, "training": {**CONFIG["training"], "lr": 3e-5}}
    resumed = RunLog(tmp_path, ["mlflow"], "my-run", changed)
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "RUNNING"
    resumed.log(3, {"rewards/a/mean": 1.0})
    resumed.close()
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert json.loads((tmp_path / "logger_runs.json").read_text())["mlflow"] == {
        "tracking_uri": f"file:{tmp_path}/mlruns", "run_id": run.info.run_id}
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rewards/a/mean")] == \
        [(1, 0.25), (2, 0.75), (3, 1.0)]
    assert run.data.params["training.lr"] == "1e-05" and run.data.tags["resumed.training.lr"] == "3e-05"
    client.delete_run(run.info.run_id)  # a run deleted since: the next opening starts a new one
    RunLog(tmp_path, ["mlflow"], "my-run", CONFIG).close()
    [new] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert new.info.run_id != run.info.run_id


# --- the loggers' servers, checked before Ray starts (issue 50) ---

import contextlib
import http.server
import socket
import threading

from gdpo_ray.run import cluster, loggers
from gdpo_ray.run.cli import main


@contextlib.contextmanager
def http_server(status: int, body: bytes):
    """A local HTTP server answering every GET with ``status`` and ``body``; yields its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.server.paths.append(self.path)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.paths = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.paths
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def before_ray(monkeypatch, tmp_path):
    """`gdpo-ray train` / `check` from a scratch folder; starting Ray (the background start
    included) fails the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cluster, "begin", lambda run: pytest.fail("Ray was started"))
    monkeypatch.setattr(cluster, "start_ray", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    return tmp_path


TRAIN = ["run.loggers=[jsonl,mlflow]", "run.output_dir=runs", "run.steps=1"]


@pytest.mark.parametrize("command", ["train", "check"])
def test_an_mlflow_uri_nothing_listens_on_fails_the_command_before_ray(before_ray, monkeypatch, capsys, command):
    uri = f"http://127.0.0.1:{closed_port()}/"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    start = time.monotonic()
    assert main([command, "demo", *TRAIN]) == 2
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert f"run.loggers: mlflow logs to MLFLOW_TRACKING_URI={uri}, which cannot be reached (" in err
    assert "unset it to log into the run directory (file:<run_dir>/mlruns), or leave mlflow out of run.loggers" in err
    assert not (before_ray / "runs").exists()


def test_an_mlflow_uri_that_does_not_answer_fails_within_the_probes_timeout(before_ray, monkeypatch, capsys):
    """A server that accepts the connection and never answers, and an address no route leads to
    (a firewall's silence; where something on the way answers for it, what it answered): each
    fails within the probe's timeout (1 s here; 5 s by default), naming the URI."""
    monkeypatch.setattr(loggers, "PROBE_TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts; nobody reads or answers
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        start = time.monotonic()
        assert main(["train", "demo", *TRAIN]) == 2
        assert time.monotonic() - start < 4
    assert f"MLFLOW_TRACKING_URI={uri}, which did not answer within 1 s; start the tracking server" in \
        capsys.readouterr().err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.255.255.1:5000")
    start = time.monotonic()
    assert main(["train", "demo", *TRAIN]) == 2
    assert time.monotonic() - start < 4
    assert "run.loggers: mlflow logs to MLFLOW_TRACKING_URI=http://10.255.255.1:5000, which " in capsys.readouterr().err


def test_the_probe_asks_what_mlflows_client_asks_first_and_knows_its_answers(monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "my runs")
    missing = b'{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Could not find experiment"}'
    for status, body in ((404, missing), (200, b'{"experiment": {}}'), (401, b"login")):
        with http_server(status, body) as (url, paths):
            monkeypatch.setenv("MLFLOW_TRACKING_URI", url + "/")
            assert check_loggers(["mlflow"]) == ["mlflow"]
            assert paths == ["/api/2.0/mlflow/experiments/get-by-name?experiment_name=my%20runs"]
    # another service at the address, and a gateway with nothing behind it
    for status, body, said in ((404, b"<html>Not Found</html>", "answered HTTP 404 at /api/2.0/mlflow/experiments/"
                                "get-by-name, as no MLflow tracking server does"),
                               (503, b"", "answered HTTP 503 (a gateway with no server behind it)")):
        with http_server(status, body) as (url, _):
            monkeypatch.setenv("MLFLOW_TRACKING_URI", url.replace("http://", "http://me:secret@"))
            with pytest.raises(ValueError) as err:
                check_loggers(["mlflow"])
            assert f"MLFLOW_TRACKING_URI={url}, which {said}" in str(err.value)  # no credentials shown


def test_local_mlflow_stores_and_offline_wandb_need_no_network(monkeypatch):
    monkeypatch.setattr(loggers, "_probe", lambda *a: pytest.fail("probed"))
    for uri in ("", "file:/tmp/mlruns", "/tmp/mlruns", "mlruns", "sqlite:///mlflow.db", "databricks"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert check_loggers(["mlflow"]) == ["mlflow"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert check_loggers(["wandb"]) == ["wandb"]


def test_online_wandb_needs_its_server_to_answer(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # online
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("WANDB_BASE_URL", uri)
    with pytest.raises(ValueError, match=rf"run.loggers: wandb logs online \(an API key is set, or WANDB_MODE=online\) "
                                         rf"to {uri}, which cannot be reached .* log offline with WANDB_MODE=offline"):
        check_loggers(["wandb"])
    with http_server(404, b"") as (url, _):
        monkeypatch.setenv("WANDB_BASE_URL", url)
        assert check_loggers(["wandb"]) == ["wandb"]
