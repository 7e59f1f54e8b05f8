"""Run untrusted, model-generated programs: Linux namespaces, an unprivileged uid, hard limits.

Each call starts ``unshare`` with fresh pid, network, mount, IPC and UTS namespaces, whose
process 1 is ``_sandbox_init.py``. Every run of the program then happens in its own mount and
IPC namespaces and a further user namespace, as an unprivileged uid chosen at random for this
call, with:
  - no network at all (a new network namespace has only a loopback that is down);
  - a fresh process tree that cannot see or signal anything outside it; every process left
    behind after a run (daemons, ``setsid`` escapees) is killed, and the namespace dies with
    its process 1;
  - the whole file system read-only, and a new tmpfs for /tmp (the work directory) and
    /dev/shm in every run; no SysV or POSIX IPC object and no keyring of an earlier run or of
    the trainer;
  - an empty environment, no new privileges, and a seccomp filter that answers ENOSYS to the
    system calls a test program never needs (``_sandbox_init.DENIED``: io_uring, bpf,
    keyrings, ptrace, perf events, ...);
  - limits on CPU time, wall time, address space, processes, file size and output size, and
    one cgroup per call (memory, processes) that only the program's processes join.

The verdict on a failure: until the program's first run has started (its ``exec``), a failure
is the sandbox's (``SandboxUnavailable``: the code rewards record NaN, "could not be
computed"). From then on, anything that ends the call early (the init killed or crashed, the
call's time spent) is the program's: the run in progress gets a ``RunResult`` with ``aborted``
(not ``ok``: it fails its test), and the runs after it are run in a fresh call within the same
time bound.

Code runs only here: there is no switch to run it unconfined. Where the namespaces cannot be
created (not root, or a kernel or container that forbids them) ``SandboxUnavailable`` is raised
and the code rewards record NaN rather than run the program.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
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
        """Upper bound of one ``run_program`` with ``runs`` runs, a fresh sandbox for the runs
        after an aborted one included (what a reward timeout must exceed)."""
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
    #: why the sandbox call ended during this run, after the program had started (its init
    #: killed or crashed, the call's time spent): the program's failure, never the sandbox's
    aborted: str | None = None

    @property
    def ok(self) -> bool:
        """Ran to the end and exited 0 (no compile or runtime error, timeout, limit kill or
        aborted call)."""
        return self.exit_code == 0 and not (self.timed_out or self.output_exceeded or self.aborted)


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
    if os.uname().machine not in ("x86_64", "aarch64"):
        raise SandboxUnavailable(
            f"the code sandbox's seccomp filter knows the system calls of x86_64 and aarch64; "
            f"this machine is {os.uname().machine}")


#: host directories a program may see (read-only): the system's binaries and libraries
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@functools.lru_cache(maxsize=1)
def _interpreter_paths() -> tuple[list[str], list[str]]:
    """(what to expose: the system directories and the interpreter's installation; what to
    hide inside them: every site-packages and dist-packages directory of a Python installation
    there, ``[lib*/]python*/*-packages`` and ``local/lib*/python*/*-packages`` under each, and
    every one on this interpreter's path, its venv's and the user's), whatever the prefix.
    A program that puts Debian's dist-packages on its ``sys.path``, or runs /usr/bin/python3,
    finds them empty."""
    import site

    base = os.path.realpath(sys.base_prefix)
    expose = [*SYSTEM_DIRS, base] if not base.startswith(("/usr/", "/usr")) else list(SYSTEM_DIRS)
    prefixes = list(dict.fromkeys([sys.prefix, sys.base_prefix, base]))
    found = [*site.getsitepackages(prefixes), site.getusersitepackages()]
    found += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    for root in expose:
        for pattern in ("python*/*-packages", "lib*/python*/*-packages",
                        "local/lib*/python*/*-packages"):
            found += glob.glob(os.path.join(root, pattern))
    return expose, sorted({os.path.realpath(p) for p in found})


def run_program(files: dict[str, str], runs: list[dict], limits: Limits) -> list[RunResult]:
    """Runs ``runs`` (each ``{"argv": [...], "stdin": str}``) over ``files`` in one sandbox.

    ``argv[0]`` is the interpreter (``sys.executable``; symbolic links, such as a venv's
    python, are resolved to the real binary, which the sandbox exposes); the files are in the
    working directory, fresh for every run. Raises SandboxUnavailable when the sandbox failed
    before the program's first run started; once it has, a call that ends early marks the run
    in progress ``aborted`` and runs the rest in a fresh call (the module docstring), all
    within ``limits.total_s(len(runs))``.
    """
    check_available()
    runs = [dict(r, argv=[os.path.realpath(r["argv"][0]), *r["argv"][1:]]) for r in runs]
    deadline = time.monotonic() + limits.total_s(len(runs))
    results: list[RunResult] = []
    program_ran = False
    while len(results) < len(runs):
        left = deadline - time.monotonic()
        todo = runs[len(results):]
        if left <= 0:
            results += [_aborted("the call's time bound was spent by the earlier runs")] * len(todo)
            break
        done, started, failure = _call(files, todo, limits, left)
        results += done
        if len(done) == len(todo):  # every run reported (a failure after the last is moot)
            break
        program_ran = program_ran or started or bool(done)
        if not program_ran:
            raise SandboxUnavailable(failure)
        results.append(_aborted(failure))
    return results


def _aborted(why: str) -> RunResult:
    return RunResult(exit_code=None, signal=None, timed_out=False, output_exceeded=False,
                     stdout="", stderr="", wall_s=0.0, aborted=why)


def _call(files: dict[str, str], runs: list[dict], limits: Limits,
          timeout: float) -> tuple[list[RunResult], bool, str]:
    """One sandbox over ``runs``: (the results of the runs that finished, in order; whether
    the next run's program had started; why the call ended early, "" when it did not)."""
    expose, hide = _interpreter_paths()
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
                                  env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=timeout)
            out, err = done.stdout, done.stderr
            failure = "" if done.returncode == 0 else f"the sandbox failed (exit {done.returncode})"
        except subprocess.TimeoutExpired as exc:  # the init is killed with unshare
            out, err = exc.stdout or b"", exc.stderr or b""
            failure = f"the sandbox did not finish in {timeout:.0f} s"
        except OSError as exc:
            out, err, failure = b"", b"", f"the sandbox could not start: {exc}"
    frames = _frames(out)
    results = [RunResult(**frame[2]) for frame in frames if frame[0] == "result"]
    started = ({f[1] for f in frames if f[0] == "start"}
               - {f[1] for f in frames if f[0] == "setup_failed"})
    if not failure and len(results) < len(runs):
        failure = "the sandbox ended before reporting every run"
    detail = err.decode(errors="replace").strip()[-500:]
    return results, len(results) in started, f"{failure}: {detail}" if detail else failure


def _frames(data: bytes) -> list[tuple]:
    """The init's report (``_sandbox_init.emit``: 4-byte length, then marshal data), up to
    the first incomplete frame."""
    frames, at = [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        if at + 4 + size > len(data):
            break
        try:
            frames.append(marshal.loads(data[at + 4:at + 4 + size]))
        except (EOFError, ValueError, TypeError):
            break
        at += 4 + size
    return frames


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
    them afterwards; yields the ``cgroup.procs`` files each run's process joins before the
    program starts (empty where this machine allows none: then only the per-process limits
    hold, see ``cgroup_support``). The sandbox's init stays outside: nothing the program
    allocates is charged to it, and the cgroup's OOM killer cannot choose it."""

    def __init__(self, limits: Limits) -> None:
        # a call's memory: one process at its limit, its tmpfs (/tmp, /dev/shm), and 64 MiB for
        # the kernel's share (page tables, namespaces); the init is not in the cgroup
        self.memory = (limits.memory_mb + 2 * limits.disk_mb + 64) << 20
        self.pids = limits.processes
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
