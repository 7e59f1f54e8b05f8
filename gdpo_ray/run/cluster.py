"""Ray for a run: the job's cluster inside ``ray job submit`` (``RAY_ADDRESS`` set), the cluster
at ``run.address``, or a local one of ``run.num_cpus`` logical CPUs with token authentication
off (``RAY_AUTH_MODE=disabled``, the local-cluster setting); from Python (``config.build_algo()``)
the one running, else one started as RLlib's algorithms start theirs (``ensure_ray``).

A local Ray takes seconds to come up (GCS, raylet, dashboard, agents: 4-5 s here, most of it
waiting on its own processes), so ``gdpo-ray train`` starts it in the background
(``BackgroundRay``) as soon as the ``run`` section is read, while the driver imports RLlib,
validates the config and runs the start-up check. No actor starts before all of those pass; a
run that fails one prints its error, then stops the Ray it was starting before it returns.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator

#: quiet workers: no per-actor progress bars of transformers / huggingface_hub
WORKER_ENV = {"RAY_AUTH_MODE": "disabled", "TRANSFORMERS_VERBOSITY": "error",
              "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
              "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
#: a local cluster starts no idle workers ahead of time: every actor of a run asks for a runtime
#: env of its own, so none could take one, and each costs a core-second and ~40 MB at start-up
LOCAL_RAY_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
#: what ``ray.init`` imports to start a local cluster, imported before it runs beside the
#: driver's own imports: two threads importing one package's circular modules from either end
#: can fail (Python's import deadlock error); with these loaded, ``ray.init`` imports nothing more
RAY_INIT_IMPORTS = ("ray._private.node", "ray._private.services", "ray._private.state", "ray.job_config",
                    "ray._common.usage.usage_lib", "ray._private.runtime_env.uv_runtime_env_hook",
                    "ray._private.thirdparty.pynvml", "ray.autoscaler._private.util",
                    "ray.autoscaler.v2.utils", "ray.dashboard.optional_deps", "aiohttp.web",
                    "aiohttp_cors", "grpc.aio", "opentelemetry.exporter.prometheus",
                    "opentelemetry.sdk.metrics", "prometheus_client", "pydantic", "click", "colorful",
                    "wsgiref.simple_server", "timeit", "netrc", "gzip")


def is_local(address: str | None) -> bool:
    """Whether ``start_ray(address, ...)`` would start a local cluster (none is up, no address)."""
    import ray

    return not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"))


def start_ray(address: str | None, num_cpus: int, py_modules: list[str]) -> None:
    """Ray for a run (a no-op when it is up already): the job's cluster inside `ray job
    submit`, the cluster at ``address`` (``py_modules``, the user's reward modules, go along),
    else a local cluster of ``num_cpus`` CPUs whose workers import from this checkout and from
    the current folder."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # inside `ray job submit`: the job's runtime env holds
        ray.init(logging_level=logging.WARNING)  # (working_dir: the user's code)
    elif address:
        ray.init(address=address, logging_level=logging.WARNING,
                 runtime_env={"env_vars": WORKER_ENV, "py_modules": py_modules})
    else:
        _start_local(num_cpus)


def ensure_ray(config: Any) -> None:
    """Ray for a GDPO built from Python (``config.build_algo()``), as RLlib's own algorithms
    start it on first use: the one running (``ray.init(...)`` called first chooses it), the
    cluster at ``$RAY_ADDRESS``, else a local one (``start_ray``) of the machine's CPUs, or of
    what the run's actors ask for where that is more (they share the cores, as ``gdpo-ray
    train``'s ``run.num_cpus: 4`` does on a 2-core laptop)."""
    import math

    import ray

    if ray.is_initialized():
        return
    from gdpo_ray.run.placement import demand

    cpus = max(os.cpu_count() or 1, math.ceil(demand(config).get("CPU", 0)))
    if not os.environ.get("RAY_ADDRESS"):
        logging.getLogger(__name__).info("no Ray is running: starting a local Ray of %d CPUs", cpus)
    start_ray(None, cpus, [])


def _start_local(num_cpus: int) -> None:
    """A local cluster whose workers load the actor classes from this checkout's modules, which
    the driver then does not export (Ray's export hashes a class's disassembly: 0.3-0.4 s per
    actor class)."""
    import ray
    from ray.job_config import JobConfig

    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=num_cpus, include_dashboard=False,
             logging_level=logging.WARNING, _system_config=LOCAL_RAY_CONFIG,
             job_config=JobConfig(code_search_path=[root, os.getcwd()]),
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


class BackgroundRay:
    """A local cluster started on a thread of its own while the caller goes on: ``wait()`` for
    it before the first actor; ``stop()`` it when the run ends before using it.

    The thread outlives ``ray.init``: Ray ties its daemons to the thread that started them (on
    Linux, ``PR_SET_PDEATHSIG`` fires when that thread ends, not the process), so it stays while
    that Ray is up and shuts it down itself before it ends: after ``stop()``, once the start is
    done (a start cannot be cut short; the caller does not wait for it: an error is said at
    once, and the process exits when the thread is done), or when the main thread has finished
    (the process is exiting: before ``ray.init``'s own exit hook, which then has nothing to do)."""

    def __init__(self, num_cpus: int) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        for name in RAY_INIT_IMPORTS:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        self._up = threading.Event()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(num_cpus,), name="gdpo-ray-start")
        self._thread.start()

    def _run(self, num_cpus: int) -> None:
        import ray

        try:
            with _no_sigterm_warning(), _no_failure_handler_in_driver():
                _start_local(num_cpus)
        except BaseException as err:  # noqa: BLE001 - handed to wait(), in the caller's thread
            self._error = err
            return
        finally:
            self._up.set()
        main = threading.main_thread()
        while not self._stopped.wait(0.25) and main.is_alive() and ray.is_initialized():
            pass
        if self._stopped.is_set() or not main.is_alive():  # (not a Ray someone else started since)
            ray.shutdown()

    def wait(self) -> None:
        """Until the cluster is up; its start's error, if it failed, raised here."""
        self._up.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Shut the cluster down once it is up, without waiting for it."""
        self._stopped.set()


@contextlib.contextmanager
def _no_failure_handler_in_driver() -> Iterator[None]:
    """``ray.init`` installs abseil's failure signal handler in the driver, SIGTERM among its
    signals: a C stack dump, then the previous handler, then an abort 3 s later. On the main
    thread ``ray.init`` puts a Python handler over it; off it (here) nothing does, so a SIGTERM
    while the run is checked (a demo model's warm start) would dump, and abort the run's own
    clean stop (``train.StopSignals``). This driver goes without it (Ray's
    ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when the driver's core worker starts; the workers
    keep theirs, and faulthandler, which ``ray.init`` enables, still prints a crash's Python stack)."""
    from ray._private import ray_constants

    before = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = before


@contextlib.contextmanager
def _no_sigterm_warning() -> Iterator[None]:
    """``ray.init`` off the main thread warns that it set no SIGTERM handler: the run's own
    (``StopSignals``) is the one that counts, so the warning says nothing to the user."""
    logger = logging.getLogger("ray._private.worker")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def begin(run: dict[str, Any]) -> BackgroundRay | None:
    """A local cluster for the run settings ``run``, started in the background; None where the run
    joins a cluster (``start_ray`` connects then: it takes no time worth hiding)."""
    return BackgroundRay(run["num_cpus"]) if is_local(run["address"]) else None
