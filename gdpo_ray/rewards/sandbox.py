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


def run_program(files: dict[str, str], runs: list[dict], limits: Limits) -> list[RunResult]:
    """Runs ``runs`` (each ``{"argv": [...], "stdin": str}``) over ``files`` in one sandbox.

    ``argv[0]`` is a path visible in the sandbox (the interpreter); the files are in the working
    directory. Raises SandboxUnavailable when the sandbox itself could not run.
    """
    check_available()
    spec = {
        "files": files,
        "runs": runs,
        "uid": random.randrange(200_000, 2_000_000),
        "expose": sorted({sys.base_prefix, sys.prefix}),
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
