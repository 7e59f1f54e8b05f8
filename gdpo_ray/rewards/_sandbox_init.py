"""The init process of a code sandbox (stdlib only; run as ``python -I -S`` by path).

Started by ``gdpo_ray.rewards.sandbox`` as process 1 of fresh pid, network, mount, IPC and UTS
namespaces (``unshare``), still as the host's root. It:
  0. joins the call's cgroups (memory and process caps for the whole call), when given;
  1. builds a new root file system (``build_root``) and pivots into it: the interpreter and
     the system's libraries read-only, site-packages hidden, device nodes, private tmpfs;
  2. for each run: a fresh /tmp/work with the program's files (owned by the sandbox uid), and a
     forked child that enters a new user namespace (in which no further user namespace can be
     created), drops to the unprivileged sandbox uid with resource limits, no new privileges and
     an empty environment, and execs the program; the output is read up to a cap, the wall time
     bounded; afterwards every process left in the namespace is killed and reaped;
  3. writes the list of run results to stdout.
Input and output are ``marshal`` data (built in, so the sandbox starts without importing json).
When this process exits, the kernel kills whatever is left in the pid namespace.
"""

import ctypes
import marshal
import os
import resource
import select
import sys
import time

CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
READ_ONLY = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
PR_SET_NO_NEW_PRIVS = 38
SIGKILL = 9  # not from `signal`: its import (enum) adds ~3.5 ms to every sandbox start
WORK = "/tmp/work"

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}


def pivot_root(new_root, put_old):
    number = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}[os.uname().machine]
    _check(libc.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")


def build_root(expose, hide, disk_mb):
    """A new root file system holding only ``expose`` (read-only binds of the host's system
    directories and the interpreter's installation, with the ``hide`` directories inside them,
    its site-packages, covered by empty read-only tmpfs), the usual device nodes, a fresh /proc,
    and private tmpfs for /tmp (the work directory) and /dev/shm. Nothing else of the host (the
    project, datasets, run outputs, other packages) exists in it."""
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
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,nr_inodes=4096,mode=1777")
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,nr_inodes=4096,mode=1777")
    os.makedirs(root + "/var", 0o755, exist_ok=True)
    os.symlink("/tmp", root + "/var/tmp")
    os.mkdir(root + "/.old")
    pivot_root(root, root + "/.old")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount /.old")
    os.rmdir("/.old")
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def wipe(path):
    """Removes everything below ``path`` (a run leaves nothing for the next)."""
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            wipe(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


def write_files(files, uid):
    """A fresh work directory with the program's files (before every run)."""
    for scratch in ("/tmp", "/dev/shm"):
        wipe(scratch)
    os.mkdir(WORK, 0o700)
    for name, text in files.items():
        path = os.path.join(WORK, name)
        with open(path, "w") as f:
            f.write(text)
        os.chown(path, uid, uid)
    os.chown(WORK, uid, uid)


def child(argv, uid, limits, ready_w, go_r, stdin_r, out_w, err_w):
    """In the forked child: new user namespace, limits, unprivileged uid, exec."""
    try:
        os.setgroups([])
        _check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
        with open("/proc/sys/user/max_user_namespaces", "w") as f:  # no nested namespaces
            f.write("0")
        os.write(ready_w, b"1")
        os.read(go_r, 1)  # the parent has written our uid/gid maps
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
        os.chdir(WORK)
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        os.execve(argv[0], argv, {})
    except BaseException as err:  # noqa: BLE001 - report anything, then die
        os.write(2, f"sandbox: {err}\n".encode())
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


def run_one(run, uid, limits):
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(run["argv"], uid, limits, ready_w, go_r, stdin_r, out_w, err_w)
    for fd in (ready_w, go_r, stdin_r, out_w, err_w):
        os.close(fd)
    if os.read(ready_r, 1) == b"1":
        for kind in ("uid", "gid"):
            with open(f"/proc/{pid}/{kind}_map", "w") as f:
                f.write(f"{uid} {uid} 1\n")
        os.write(go_w, b"1")
    os.close(go_w)
    os.close(ready_r)
    data = run.get("stdin", "").encode()
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
    kill_everything_else()
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


def main():
    spec = marshal.loads(sys.stdin.buffer.read())
    uid, limits = spec["uid"], spec["limits"]
    for procs in spec["cgroups"]:  # the whole call's memory and process caps
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    build_root(spec["expose"], spec["hide"], limits["disk_mb"])
    results = []
    for run in spec["runs"]:
        write_files(spec["files"], uid)
        results.append(run_one(run, uid, limits))
    sys.stdout.buffer.write(marshal.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
