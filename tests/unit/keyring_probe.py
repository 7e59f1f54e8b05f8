"""Run by test_sandbox (``python _keyring_probe.py LIMITS_JSON``): in a session keyring of its
own (so nothing of the machine's is touched) it plants a secret, runs ``PROBE`` unconfined,
then scores ``PROBE`` with code_passrate in the sandbox, and prints a JSON report.

``PROBE`` does what the issue found a program could do with the trainer's session keyring:
it reads the secret (its stdout, which is also the test's expected output), adds a key and
clears the keyring (both reported on stderr)."""

import ctypes
import json
import os
import subprocess
import sys
import uuid

PROBE = """\
import ctypes, os, sys
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
SEARCH, READ, CLEAR, SESSION = 10, 11, 7, ctypes.c_long(-3)
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
key = libc.syscall(L(KEYCTL), L(SEARCH), SESSION, b"user", b"gdpo-test-secret", L(0))
search_errno = ctypes.get_errno()
secret = b""
if key > 0:
    buf = ctypes.create_string_buffer(256)
    size = libc.syscall(L(KEYCTL), L(READ), L(key), buf, L(256))
    secret = buf.raw[:size]
added = libc.syscall(L(ADD_KEY), b"user", b"gdpo-test-planted", b"x", L(1), SESSION)
add_errno = ctypes.get_errno()
cleared = libc.syscall(L(KEYCTL), L(CLEAR), SESSION)
clear_errno = ctypes.get_errno()
print(secret.decode())
print(f"search errno {search_errno}; add_key {added} errno {add_errno}; clear {cleared} errno "
      f"{clear_errno}", file=sys.stderr)
"""

ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
JOIN, READ, SESSION = 1, 11, ctypes.c_long(-3)
L = ctypes.c_long
libc = ctypes.CDLL(None, use_errno=True)


def plant(secret: str) -> int:
    return libc.syscall(L(ADD_KEY), b"user", b"gdpo-test-secret", secret.encode(),
                        L(len(secret)), SESSION)


def read(key) -> bytes:
    buf = ctypes.create_string_buffer(4096)
    size = libc.syscall(L(KEYCTL), L(READ), key, buf, L(4096))
    return buf.raw[:max(size, 0)]


def session_keys() -> list[int]:
    """The serials in this process's session keyring."""
    data = read(SESSION)
    return [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data), 4)]


def main() -> None:
    limits = json.loads(sys.argv[1])
    if libc.syscall(L(KEYCTL), L(JOIN), None) < 0:  # a new anonymous session keyring
        print(json.dumps({"skip": f"no session keyring here: {os.strerror(ctypes.get_errno())}"}))
        return
    secret = uuid.uuid4().hex
    first = plant(secret)
    host = subprocess.run([sys.executable, "-I", "-c", PROBE], capture_output=True, text=True,
                          timeout=60)
    report = {"secret": secret, "planted": first, "host_stdout": host.stdout,
              "host_stderr": host.stderr, "after_host": session_keys()}
    serial = plant(secret)  # the unconfined probe cleared the first one
    from gdpo_ray import rewards

    passrate = rewards.get("code_passrate", **limits)
    tests = json.dumps({"inputs": [""], "outputs": [secret + "\n"]})
    report["score"] = passrate(["p"], [f"```python\n{PROBE}\n```"], ground_truth=[tests])[0]
    report.update(serial=serial, after_sandbox=session_keys(), payload=read(L(serial)).decode())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
