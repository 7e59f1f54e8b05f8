"""Run untrusted, model-generated programs: Linux namespaces, an unprivileged uid, hard limits.

Each call starts ``unshare`` with fresh pid, network, mount, IPC and UTS namespaces, whose
process 1 is ``_sandbox_init.py``. Every run of the program then happens in a further user
namespace, as an unprivileged uid chosen at random for this call, with:
  - no network at all (a new network namespace has only a loopback that is down);
  - a fresh process tree that cannot see or signal anything outside it; every process left
    behind after a run (daemons, ``setsid`` escapees) is killed, and the namespace dies with
    its process 1;
  - the whole file system read-only, and private tmpfs for /tmp (the work directory),
    /var/tmp and /dev/shm, thrown away at the end;
  - an empty environment and no new privileges;
  - limits on CPU time, wall time, address space, processes, file size and output size.

Code runs only here: there is no switch to run it unconfined. Where the namespaces cannot be
created (not root, or a kernel or container that forbids them) ``SandboxUnavailable`` is raised
and the code rewards record NaN ("could not be computed") rather than run the program.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

INIT = Path(__file__).with_name("_sandbox_init.py")
NAMESPACES = ["--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child",
              "--mount-proc"]


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be created on this machine; code is never run without it (the code
    rewards raise it as a ``RewardInfraError``: the reward pool retries, then records NaN)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per run of the program."""

    wall_s: float = 4.0  # wall-clock time of one run
    cpu_s: int = 4  # CPU seconds of one run (RLIMIT_CPU)
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    processes: int = 16  # processes of the sandbox uid (RLIMIT_NPROC)
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    disk_mb: int = 32  # size of its /tmp
    output_bytes: int = 1 << 20  # stdout + stderr of one run

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"sandbox limit {field.name} must be > 0; got {value!r}")

    def total_s(self, runs: int) -> float:
        """Upper bound of one sandbox call with ``runs`` runs (what a reward timeout must exceed)."""
        return runs * (self.wall_s + 0.5) + 5.0


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None when killed by a signal or by a limit
    signal: int | None
    timed_out: bool
    output_exceeded: bool
    stdout: str
    stderr: str  # its last 4,000 characters
    wall_s: float

    @property
    def ok(self) -> bool:
        """Ran to the end and exited 0 (no compile or runtime error, timeout or limit kill)."""
        return self.exit_code == 0 and not (self.timed_out or self.output_exceeded)


def check_available() -> None:
    """Raises SandboxUnavailable with the reason and the fix when code cannot be run here."""
    if sys.platform != "linux":
        raise SandboxUnavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the code sandbox needs root to create pid/net/mount namespaces and switch to an "
            "unprivileged uid (run the reward workers as root, e.g. in a container)"
        )
    if shutil.which("unshare") is None:
        raise SandboxUnavailable("the code sandbox needs `unshare` (util-linux) on PATH")


#: host directories a program may see (read-only): the system's binaries and libraries
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def _interpreter_paths() -> tuple[list[str], list[str]]:
    """(what to expose: the system directories and the interpreter's installation; what to
    hide inside them: every site-packages of this interpreter, its venv's and the user's)."""
    import site

    base = os.path.realpath(sys.base_prefix)
    expose = [*SYSTEM_DIRS, base] if not base.startswith(("/usr/", "/usr")) else list(SYSTEM_DIRS)
    prefixes = list(dict.fromkeys([sys.prefix, sys.base_prefix, base]))
    hide = {os.path.realpath(p) for p in site.getsitepackages(prefixes)}
    hide |= {os.path.realpath(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    hide |= {os.path.realpath(site.getusersitepackages())}
    if base == "/usr" or base.startswith("/usr/"):  # a system Python: Debian's dist-packages too
        hide |= {"/usr/lib/python3/dist-packages", f"/usr/local/lib/python{sys.version_info[0]}."
                 f"{sys.version_info[1]}/dist-packages"}
    return expose, sorted(hide)


def run_program(files: dict[str, str], runs: list[dict], limits: Limits) -> list[RunResult]:
    """Runs ``runs`` (each ``{"argv": [...], "stdin": str}``) over ``files`` in one sandbox.

    ``argv[0]`` is the interpreter (``sys.executable``; symbolic links, such as a venv's
    python, are resolved to the real binary, which the sandbox exposes); the files are in the
    working directory, fresh for every run. Raises SandboxUnavailable when the sandbox itself
    could not run.
    """
    check_available()
    expose, hide = _interpreter_paths()
    runs = [dict(r, argv=[os.path.realpath(r["argv"][0]), *r["argv"][1:]]) for r in runs]
    with _cgroups(limits) as procs:
        spec = {
            "files": files,
            "runs": runs,
            "uid": random.randrange(200_000, 2_000_000),
            "expose": expose,
            "hide": hide,
            "cgroups": procs,
            "limits": dataclasses.asdict(limits),
        }
        cmd = ["unshare", *NAMESPACES, "--", sys.executable, "-I", "-S", str(INIT)]
        try:
            done = subprocess.run(cmd, input=marshal.dumps(spec), capture_output=True,
                                  env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                  timeout=limits.total_s(len(runs)))
        except subprocess.TimeoutExpired as err:
            raise SandboxUnavailable(f"the sandbox did not finish in {err.timeout:.0f} s") from None
    if done.returncode != 0:
        raise SandboxUnavailable(
            f"the sandbox failed to start (exit {done.returncode}): "
            f"{done.stderr.decode(errors='replace').strip()[-500:]}"
        )
    return [RunResult(**r) for r in marshal.loads(done.stdout)]


# --------------------------------------------------------------------------------------------
# cgroups: the memory (tmpfs included) and process caps of a whole call


def _own_cgroups() -> tuple[dict[str, Path], Path | None]:
    """This process's cgroup directories: {v1 controller: dir}, and the v2 one (or None)."""
    v1, v2 = {}, None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return v1, v2
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if (Path("/sys/fs/cgroup") / controller).is_dir():
                v1[controller] = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
        if hierarchy == "0" and (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
            v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
    return v1, v2


class _cgroups:
    """Creates the call's cgroups (v1 memory + pids, or v2 with both controllers) and removes
    them afterwards; yields the ``cgroup.procs`` files the sandbox's init joins (empty where
    this machine allows none: then only the per-process limits hold, see ``cgroup_support``)."""

    def __init__(self, limits: Limits) -> None:
        # a call's memory: one process at its limit, its tmpfs (/tmp, /dev/shm), and the init
        self.memory = (limits.memory_mb + 2 * limits.disk_mb + 64) << 20
        self.pids = limits.processes + 1
        self.made: list[Path] = []

    def _make(self, parent: Path, name: str, settings: dict) -> None:
        group = parent / name
        group.mkdir()
        self.made.append(group)
        for key, value in settings.items():
            if (group / key).exists():
                (group / key).write_text(str(value))

    def __enter__(self) -> list[str]:
        name = f"gdpo-sandbox-{os.getpid()}-{random.randrange(1 << 30)}"
        v1, v2 = _own_cgroups()
        try:
            if "memory" in v1 and "pids" in v1:
                self._make(v1["memory"], name, {"memory.limit_in_bytes": self.memory,
                                                "memory.memsw.limit_in_bytes": self.memory})
                self._make(v1["pids"], name, {"pids.max": self.pids})
            elif v2 is not None:
                enabled = (v2 / "cgroup.subtree_control").read_text().split()
                if not {"memory", "pids"} <= set(enabled):
                    (v2 / "cgroup.subtree_control").write_text("+memory +pids")
                self._make(v2, name, {"memory.max": self.memory, "memory.swap.max": 0,
                                      "pids.max": self.pids})
            else:
                raise OSError("no memory and pids cgroup controllers")
        except OSError as err:
            self.__exit__()
            _no_cgroups(str(err))
            return []
        return [str(g / "cgroup.procs") for g in self.made]

    def __exit__(self, *exc) -> None:
        for group in reversed(self.made):
            for _ in range(50):  # the sandbox's processes are reaped a moment after it exits
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
        self.made = []


_WARNED: list[str] = []


def _no_cgroups(reason: str) -> None:
    if not _WARNED:
        _WARNED.append(reason)
        import logging

        logging.getLogger(__name__).warning(
            "code sandbox without cgroups (%s): a call's memory is capped per process only "
            "(memory_mb x processes); run the reward workers where cgroups are writable (root "
            "with /sys/fs/cgroup mounted read-write)", reason)


def cgroup_support() -> str | None:
    """Why calls get no cgroup here (None: they do)."""
    with _cgroups(Limits()) as procs:
        return None if procs else (_WARNED[0] if _WARNED else "unknown")
