"""The init process of a code sandbox (stdlib only; run as ``python -I -S`` by path).

Started by ``gdpo_ray.rewards.sandbox`` as process 1 of fresh pid, network, mount, IPC and UTS
namespaces (``unshare``), still as the host's root. It:
  1. makes every inherited mount read-only and mounts private tmpfs on /tmp, /var/tmp, /dev/shm;
  2. writes the program's files into /tmp/work (owned by the sandbox uid);
  3. for each run: forks a child that enters a new user namespace, drops to the unprivileged
     sandbox uid with resource limits, no new privileges and an empty environment, and execs
     the program; the output is read up to a cap, the wall time bounded; afterwards every
     process left in the namespace (daemons, setsid escapees) is killed and reaped;
  4. writes the list of run results to stdout.
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
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
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


def lock_down_filesystem(disk_mb):
    mountpoints = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mountpoints.append(line.split()[4].replace("\\040", " "))
    for mp in mountpoints:
        if mp == "/proc" or mp.startswith("/proc/"):
            continue
        try:
            mount(None, mp, None, READ_ONLY)
        except OSError:
            pass  # a mount hidden under another one; what is visible is what counts
    opts = f"size={disk_mb}m,nr_inodes=4096,mode=1777"
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, opts)


def _blocking_ancestor(path):
    """The outermost directory on ``path`` that other users cannot traverse, or None."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


def open_paths(paths):
    """O_PATH handles on the paths to expose, taken before any mount can hide them."""
    return {p: os.open(p, os.O_PATH) for p in paths if os.path.isdir(p)}


def _reachable(path, fd):
    try:
        st = os.stat(path)
    except OSError:
        return False
    ref = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (ref.st_dev, ref.st_ino) and _blocking_ancestor(path) is None


def expose(fds):
    """Makes the paths of ``fds`` (the interpreter's installation) reachable, read-only, by the
    sandbox uid, at their own location.

    A path hidden by the sandbox's tmpfs (an interpreter under /tmp) is bound back into it; a
    directory on the way that others cannot traverse (say /root, mode 700) is covered by an
    empty tmpfs into which only the exposed paths are bound."""
    hidden = []
    bound = []
    for p, fd in sorted(fds.items()):
        if any(p == b or p.startswith(b + "/") for b in bound) or _reachable(p, fd):
            continue
        top = _blocking_ancestor(p) if os.path.exists(os.path.dirname(p)) else None
        if top and top not in hidden:
            mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
            hidden.append(top)
        os.makedirs(p, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        mount(None, p, None, READ_ONLY)
        bound.append(p)
    for top in hidden:
        mount(None, top, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for fd in fds.values():
        os.close(fd)


def write_files(files, uid):
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
    fds = open_paths(spec["expose"])
    lock_down_filesystem(limits["disk_mb"])
    expose(fds)
    write_files(spec["files"], uid)
    results = [run_one(run, uid, limits) for run in spec["runs"]]
    sys.stdout.buffer.write(marshal.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
