"""The init process of a code sandbox (stdlib only; run as ``python -I -S`` by path).

Started by ``gdpo_ray.rewards.sandbox`` as process 1 of fresh pid, network, mount, IPC and UTS
namespaces (``unshare``), still as the host's root. It:
  0. protects itself from the OOM killer (``oom_score_adj`` -1000 where allowed) and opens
     the call's cgroups (memory and process caps), which only the program's processes join:
     the init is never charged for, nor killed by, what the program allocates;
  1. builds a new root file system (``build_root``) and pivots into it: the interpreter and
     the system's libraries read-only, site-packages hidden, device nodes;
  2. for each run, forks a child that joins the cgroups, gets fresh mount and IPC namespaces
     (a new tmpfs on /tmp and /dev/shm holding only the program's files; no message queue,
     semaphore or shared memory of an earlier run), a fresh session keyring, enters a new user
     namespace (in which no further user namespace can be created), drops to the unprivileged
     sandbox uid with resource limits, no new privileges, the seccomp filter (``DENIED``) and
     an empty environment, and execs the program; the output is read up to a cap, the wall
     time bounded; afterwards every process left in the namespace is killed and reaped, which
     frees the run's namespaces with everything in them (nothing to wipe);
  3. reports on stdout, as it goes, in frames (4-byte length, then ``marshal`` data):
     ``("start", i)`` just before run i's program is exec'd (everything before it is the
     sandbox's own setup), ``("setup_failed", i, why)`` if that exec then fails, and
     ``("result", i, {...})`` when run i is over. The caller reads which runs the program
     reached from the frames, whatever happens to this process afterwards.
Input is ``marshal`` data (built in, so the sandbox starts without importing json).
When this process exits, the kernel kills whatever is left in the pid namespace.
"""

import ctypes
import marshal
import os
import resource
import select
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
READ_ONLY = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
EPERM, ENOSYS = 1, 38
SIGKILL = 9  # not from `signal`: its import (enum) adds ~3.5 ms to every sandbox start
WORK = "/tmp/work"
MACHINE = os.uname().machine

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def syscall(name, *args):
    """A system call without a libc wrapper, by name (its number in ``DENIED``: the init makes
    it before the filter applies); -1 and errno on failure."""
    return libc.syscall(ctypes.c_long(DENIED[name][ARCHES[MACHINE][0]]), *args)


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


# --------------------------------------------------------------------------------------------
# system calls: numbers, and the seccomp filter of every program

#: what the seccomp filter denies every program: name -> (x86_64, aarch64) number, None where
#: the architecture has no such call. A denied call fails with ENOSYS, as on a kernel without
#: it, so a program probing for a feature falls back instead of failing.
DENIED = {
    # kernel attack surface reachable without privileges
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "fanotify_init": (300, 262), "syslog": (103, 116),
    # keyrings: whatever the trainer keeps there is not the program's
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    # other processes' memory, and files by handle
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_getfd": (438, 438),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    # mounts, namespaces and the machine (they need privileges the program lacks: denied twice)
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "setns": (308, 268), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "acct": (163, 89), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "lookup_dcookie": (212, 18), "vhangup": (153, 58),
    "modify_ldt": (154, None), "iopl": (172, None), "ioperm": (173, None),
    "uselib": (134, None), "_sysctl": (156, None),
}
#: machine -> (column of DENIED, AUDIT_ARCH_* of its native calls); the sandbox runs nowhere else
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
X32_SYSCALL_BIT = 0x40000000


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_filter(machine=MACHINE):
    """The classic-BPF program of the filter: a call from another ABI (i386 or x32 on x86_64,
    arm32 on aarch64) or in ``DENIED`` fails with ENOSYS, everything else is allowed.
    Returns (the ``sock_fprog``, the instruction array it points to, kept alive with it)."""
    index, audit_arch = ARCHES[machine]
    ld_w_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | ENOSYS  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    numbers = sorted({nrs[index] for nrs in DENIED.values() if nrs[index] is not None})
    # seccomp_data: int nr at offset 0, u32 arch at offset 4; "DENY" is resolved below
    code = [(ld_w_abs, 0, 0, 4), (jeq, 0, "DENY", audit_arch), (ld_w_abs, 0, 0, 0)]
    if machine == "x86_64":
        code.append((jge, "DENY", 0, X32_SYSCALL_BIT))
    code += [(jeq, "DENY", 0, nr) for nr in numbers]
    code += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    last = len(code) - 1
    resolve = lambda i, j: last - i - 1 if j == "DENY" else j  # noqa: E731 - relative jumps
    program = (SockFilter * len(code))(*[SockFilter(c, resolve(i, jt), resolve(i, jf), k)
                                         for i, (c, jt, jf, k) in enumerate(code)])
    return SockFprog(len(code), program), program  # keep the array alive with the header


# --------------------------------------------------------------------------------------------
# the root file system

DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}


def pivot_root(new_root, put_old):
    _check(syscall("pivot_root", new_root.encode(), put_old.encode()), "pivot_root")


def build_root(expose, hide):
    """A new root file system holding only ``expose`` (read-only binds of the host's system
    directories and the interpreter's installation, with the ``hide`` directories inside them,
    every site-packages, covered by empty read-only tmpfs), the usual device nodes, a fresh
    /proc, and empty /tmp and /dev/shm on which each run mounts its own tmpfs. Nothing else of
    the host (the project, datasets, run outputs, other packages) exists in it."""
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    root = "/tmp/root"
    os.mkdir(root)
    mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,nr_inodes=4096,mode=755")
    for path in expose:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            if not os.path.lexists(target):
                os.symlink(os.readlink(path), target)
        elif os.path.isdir(path) and not os.path.exists(target):
            os.makedirs(target, 0o755)
            mount(path, target, None, MS_BIND | MS_REC)
            mount(None, target, None, READ_ONLY)
    for path in hide:
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=755")
    dev = root + "/dev"
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{dev}/{name}", "w").close()
            mount("/dev/" + name, f"{dev}/{name}", None, MS_BIND)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(dev + "/shm")
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/tmp")
    os.makedirs(root + "/var", 0o755, exist_ok=True)
    os.symlink("/tmp", root + "/var/tmp")
    os.mkdir(root + "/.old")
    pivot_root(root, root + "/.old")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount /.old")
    os.rmdir("/.old")
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)


# --------------------------------------------------------------------------------------------
# one run


def fresh_scratch(files, uid, disk_mb):
    """In the run's own mount namespace: new tmpfs on /tmp (the work directory with the
    program's files, owned by the sandbox uid) and /dev/shm. They vanish with the run."""
    opts = f"size={disk_mb}m,nr_inodes=4096,mode=1777"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    os.mkdir(WORK, 0o700)
    for name, text in files.items():
        path = os.path.join(WORK, name)
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:  # any text: the
            f.write(text)  # interpreter, not the sandbox, rejects what is not UTF-8
        os.chown(path, uid, uid)
    os.chown(WORK, uid, uid)


def new_session_keyring():
    """Joins a new, empty session keyring (the one inherited is the trainer's). Where the
    kernel or the host's own seccomp filter has no keyrings the program has none either."""
    if syscall("keyctl", ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        err = ctypes.get_errno()
        if err not in (ENOSYS, EPERM):
            raise OSError(err, f"keyctl(join session keyring): {os.strerror(err)}")


def child(spec, run, pipes):
    """In the forked child: the run's cgroups, namespaces, files and keyring, then a new user
    namespace, limits, the unprivileged uid and the seccomp filter, and exec. Any failure
    before the exec is written to the status pipe (the sandbox's failure, not the program's)."""
    uid, limits = spec["uid"], spec["limits"]
    ready_w, go_r, status_w, stdin_r, out_w, err_w = pipes
    try:
        for fd in spec["cgroup_fds"]:
            os.write(fd, str(os.getpid()).encode())
        with open("/proc/self/oom_score_adj", "w") as f:  # the program dies first, not the init
            f.write("1000")
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare(mount, ipc)")
        fresh_scratch(spec["files"], uid, limits["disk_mb"])
        new_session_keyring()
        os.setgroups([])
        _check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
        with open("/proc/sys/user/max_user_namespaces", "w") as f:  # no nested namespaces
            f.write("0")
        os.write(ready_w, b"1")
        if os.read(go_r, 1) != b"1":  # the parent has written our uid/gid maps
            raise OSError("the sandbox's init did not map the uid")
        mem = limits["memory_mb"] * 1024 * 1024
        for res, value in (
            (resource.RLIMIT_AS, mem),
            (resource.RLIMIT_DATA, mem),
            (resource.RLIMIT_CPU, limits["cpu_s"]),
            (resource.RLIMIT_NPROC, limits["processes"]),
            (resource.RLIMIT_FSIZE, limits["file_mb"] * 1024 * 1024),
            (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(res, (value, value))
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(spec["seccomp"][0]),
                          0, 0), "prctl(seccomp)")
        os.chdir(WORK)
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        low, high = sorted((go_r, status_w))  # both stay open to the exec (close-on-exec)
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, 1 << 16)
        os.write(status_w, b"E")  # set up: the init records that the program starts now
        if os.read(go_r, 1) != b"2":
            raise OSError("the sandbox's init did not confirm the start")
        argv = run["argv"]
        os.execve(argv[0], argv, {})
    except BaseException as err:  # noqa: BLE001 - report anything, then die
        try:
            os.write(status_w, str(err).encode()[:4000])
        except OSError:
            pass
    os._exit(127)


def kill_everything_else():
    """SIGKILL every other process of this pid namespace, then reap them all."""
    try:
        os.kill(-1, SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def read_all(fd):
    """Everything until end of file, then closes ``fd``."""
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            os.close(fd)
            return data
        data += chunk


class SetupFailed(Exception):
    """The sandbox could not start run i's program (reported, then this process exits 3)."""


def start_run(spec, i, run):
    """Forks and sets up run i's child up to the exec; returns (pid, stdin, stdout, stderr fds)
    of the running program, or raises SetupFailed."""
    uid = spec["uid"]
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    status_r, status_w = os.pipe()
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child(spec, run, (ready_w, go_r, status_w, stdin_r, out_w, err_w))
    for fd in (ready_w, go_r, status_w, stdin_r, out_w, err_w):
        os.close(fd)
    started = False
    try:
        if os.read(ready_r, 1) == b"1":
            for kind in ("uid", "gid"):
                with open(f"/proc/{pid}/{kind}_map", "w") as f:
                    f.write(f"{uid} {uid} 1\n")
            os.write(go_w, b"1")
        status = os.read(status_r, 4096)
        if status == b"E":
            emit(("start", i))
            started = True
            os.write(go_w, b"2")
            status = read_all(status_r)  # empty when the exec succeeded (close-on-exec)
        else:
            status = status + read_all(status_r) or b"its process died before the exec"
    except OSError as err:  # the child died between two steps (EPIPE)
        status = str(err).encode()
    finally:
        os.close(go_w)
        os.close(ready_r)
    if status:
        why = f"run {i}: {status.decode(errors='replace')}"
        if started:  # the exec itself failed: the program never ran
            emit(("setup_failed", i, why))
        raise SetupFailed(why)
    return pid, stdin_w, out_r, err_r


def run_one(spec, i, run):
    limits = spec["limits"]
    pid, stdin_w, out_r, err_r = start_run(spec, i, run)
    start = time.monotonic()
    data = run.get("stdin", "").encode("utf-8", "surrogatepass")
    cap, wall = limits["output_bytes"], limits["wall_s"]
    out, err = bytearray(), bytearray()
    timed_out = exceeded = False
    status = None
    open_fds = {out_r: out, err_r: err}
    writing = stdin_w if data else None
    if writing is None:
        os.close(stdin_w)
    else:
        os.set_blocking(stdin_w, False)
    while status is None or open_fds:
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
        left = start + wall - time.monotonic()
        if left <= 0:
            timed_out = status is None
            break
        # once the program has exited, only drain what is already buffered (a daemon it left
        # behind may hold the pipes open)
        wait = 0.0 if status is not None else min(left, 0.05)
        ready, writable, _ = select.select(list(open_fds), [writing] if writing else [], [], wait)
        if writable:
            try:
                data = data[os.write(writing, data[:65536]):]
            except OSError:
                data = b""
            if not data:
                os.close(writing)
                writing = None
        if status is not None and not ready:
            break
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del open_fds[fd]
                os.close(fd)
                continue
            open_fds[fd] += chunk
        if len(out) + len(err) > cap:
            exceeded = True
            break
    if writing is not None:
        os.close(writing)
    kill_everything_else()  # the run's namespaces (tmpfs, IPC, keyring) go with its processes
    for fd in open_fds:
        os.close(fd)
    result = {
        "exit_code": None, "signal": None, "timed_out": timed_out, "output_exceeded": exceeded,
        "stdout": out[:cap].decode("utf-8", "replace"),
        "stderr": err[-4000:].decode("utf-8", "replace"),
        "wall_s": round(time.monotonic() - start, 4),
    }
    if status is not None:
        if os.WIFEXITED(status):
            result["exit_code"] = os.WEXITSTATUS(status)
        elif os.WIFSIGNALED(status):
            result["signal"] = os.WTERMSIG(status)
    return result


def protect_from_oom_killer():
    """oom_score_adj -1000: never the OOM killer's choice. Lowering it needs CAP_SYS_RESOURCE,
    which some containers drop; then the init keeps its score, still below every program
    process (each raises its own to 1000), and outside the call's cgroup whatever happens."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except PermissionError:
        pass


def emit(frame):
    data = marshal.dumps(frame)
    sys.stdout.buffer.write(len(data).to_bytes(4, "big") + data)
    sys.stdout.buffer.flush()


def main():
    spec = marshal.loads(sys.stdin.buffer.read())
    protect_from_oom_killer()
    # opened now, while the host's /sys/fs/cgroup is visible; each run's child joins them
    spec["cgroup_fds"] = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in spec["cgroups"]]
    build_root(spec["expose"], spec["hide"])
    spec["seccomp"] = seccomp_filter()
    for i, run in enumerate(spec["runs"]):
        try:
            emit(("result", i, run_one(spec, i, run)))
        except SetupFailed as err:
            kill_everything_else()
            sys.stderr.write(f"sandbox: {err}\n")
            sys.exit(3)


if __name__ == "__main__":
    main()
