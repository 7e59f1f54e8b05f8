"""Environment instances in processes that can be killed: one process owns one instance (made in
it, reset for each rollout it serves), and everything the environment's code does (``__init__``,
``reset``, tools, ``next_message``, ``get_reward(s)``, the rewards that read the instance, the
conversion of a result to text) runs there, each call bounded by a time limit that the owner
enforces by killing the process: a call that holds the GIL, runs C code, raises ``SystemExit`` or
ends the process stops only its own rollout's environment.

``serve`` is the process's side: ``gdpo_ray.environments.session.ToolSession`` on the instance,
each request answered whatever happens (``raised`` with the error where the code raised).
``probe`` reads the names a class's rewards give for a row before any tool call (the start-up
check: ``gdpo_ray.environments.columns``). ``EnvironmentProcess`` is the owner's side: ``ask``
sends a request and waits ``limit_s``; past it, or where the process ended, the process (and
every process it started) is killed and ``Stopped`` raised; on its owner's
``gdpo_ray.reaper.Reaper`` list while it lives, so that it is killed too where the owner ends
without closing it. ``Session`` is one rollout's environment on its process, with the rules of
docs/faults.md ("Tool environments"): a call of the rollout's own (a tool call, the next user
message) that is killed stops the environment, later calls are answered that it stopped, and
the rollout's environment-reading columns take their floor.
"""

from __future__ import annotations

import math
import os
import sys
from multiprocessing.connection import Connection
from typing import Any, Mapping, Sequence

import cloudpickle

from gdpo_ray.environments.session import ToolAnswer, ToolSession, failed
from gdpo_ray.forks import WorkerProcess, answer_requests, leader_of_own_group
from gdpo_ray.rewards.adapters import failure_text

#: seconds a new process may take to start (fork server start, imports), before its ``__init__``
START_S = 120.0


def serve(conn: Connection, payload: bytes) -> None:
    """An environment process: makes the instance, then answers requests until told to stop."""
    leader_of_own_group()
    spec, reward_specs, path, cwd = cloudpickle.loads(payload)
    sys.path[:] = path
    os.chdir(cwd)
    conn.send(("started",))
    try:
        session = ToolSession(spec.new(), spec.tools, spec.dynamic)
    except BaseException as err:  # noqa: BLE001 - reported to the owner
        conn.send(("raised", f"{spec.cls.__name__}() raised {failure_text(err)}"))
        return
    conn.send(("ok", None))
    rewards: dict[str, Any] = {}
    answer_requests(conn, lambda request: _OPS[request[0]](session, spec, reward_specs, rewards, *request[1:]))


def _reset(session: ToolSession, spec: Any, _specs: Any, _fns: Any, row: dict) -> tuple:
    observation = session.reset(row)
    return observation, session.schemas() if spec.dynamic else None


def _score(session: ToolSession, _spec: Any, specs: Sequence[Any], fns: dict, name: str, kwargs: dict) -> float:
    """A reward that reads the environment (TRL's ``environments=``), on this one rollout."""
    from gdpo_ray.rewards import call_reward, to_floats
    from gdpo_ray.rewards.adapters import ENVIRONMENTS

    if name not in fns:
        fns[name] = next(s for s in specs if s.name == name).resolve()
    return to_floats(call_reward(fns[name], **kwargs, **{ENVIRONMENTS: [session.instance]}), 1, name)[0]


_OPS = {
    "reset": _reset,
    "call": lambda session, _spec, _specs, _fns, call: session.call(call),
    "next": lambda session, *_: session.next_message(),
    "rewards": lambda session, _spec, _specs, _fns, *args: session.rewards(*args),
    "score": _score,
}


class Stopped(Exception):
    """A request past its limit, or a process that ended: the process is killed."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind, self.text = kind, text  # kind: "timeout" or "crash"


class Raised(Exception):
    """The environment's code raised (the process goes on): its error text."""


class EnvironmentProcess(WorkerProcess):
    """A process owning one instance of an environment class (``payload``: the class's
    ``EnvironmentSpec``, the rewards that read its instances, ``sys.path``, the working
    directory; ``payload_of``). Made within ``limit_s`` of starting, or ``Stopped`` / ``Raised``."""

    def __init__(self, ctx: Any, payload: bytes, limit_s: float, reaper: Any = None) -> None:
        super().__init__(ctx, serve, (payload,), reaper)
        self.busy = False
        try:
            self._wait(START_S, "did not start")
            self._wait(limit_s, "__init__ did not return")
        except Raised:
            self.kill()
            raise

    def ask(self, request: tuple, limit_s: float) -> Any:
        """``request``'s answer, within ``limit_s`` (``Stopped``: killed; ``Raised``)."""
        if not self.alive:
            raise Stopped("crash", "was stopped before")
        self.busy = True
        try:
            self.conn.send(request)
            return self._wait(limit_s, "did not return")
        except (OSError, ValueError):
            self.kill()
            raise Stopped("crash", f"ended its environment's process ({self._ending()})") from None
        finally:
            self.busy = False

    @property
    def idle(self) -> bool:
        """Alive, and no request of it is waiting for its answer (it may serve another rollout)."""
        return self.alive and not self.busy

    def _wait(self, limit_s: float, late: str) -> Any:
        try:
            ready = self.conn.poll(limit_s)
            reply = self.conn.recv() if ready else None
        except (EOFError, OSError):
            self.kill()
            raise Stopped("crash", f"ended its environment's process ({self._ending()})") from None
        if reply is None:
            self.kill()
            raise Stopped("timeout", f"{late} within {limit_s:g} s (its process was killed)")
        if reply[0] == "raised":
            raise Raised(reply[1])
        return reply[1] if len(reply) > 1 else None

    def _ending(self) -> str:
        self.process.join(timeout=1)
        code = self.process.exitcode
        return "exit code unknown" if code is None else f"exit code {code}" if code >= 0 else f"signal {-code}"


def payload_of(spec: Any, reward_specs: Sequence[Any]) -> bytes:
    return cloudpickle.dumps((spec, list(reward_specs), list(sys.path), os.getcwd()))


class Session:
    """One rollout's environment on its process: ``ToolSession``'s calls, each within
    ``limit_s``. ``stopped``: why the rollout's own calls stopped its environment, once they have:
    one of its calls (a tool, ``next_message``) was killed or ended the process, or reading its
    rewards was while its calls had left work running in the process (``left_work``: a thread, a
    process of its own; set by the owner before the rewards are read). ``lost``: why its process
    is gone otherwise (a read of its rewards that ran past its limit or ended the process by
    itself: that read's failure): the later reads fail, kind ``infra``, named so."""

    def __init__(self, process: EnvironmentProcess, limit_s: float, converses: bool) -> None:
        self.process, self.limit_s, self.converses = process, limit_s, converses
        self.stopped: str | None = None
        self.lost: str | None = None
        self.called = False  # a tool of the rollout's has run
        self.left_work = False  # its calls left a thread or a process running (``gdpo_ray.reaper.left_behind``)

    def call(self, call: Any) -> ToolAnswer:
        if self.stopped is not None:
            return ToolAnswer(f"Error: the environment stopped responding ({self.stopped}); no tool can "
                              "be called", "error")
        name = getattr(call, "name", "the call")
        self.called = True
        try:
            return self.process.ask(("call", call), self.limit_s)
        except Raised as err:
            return ToolAnswer(f"Error: {err}", "error")
        except Stopped as err:
            self.stopped = f"its {name} call {err.text}"
            return ToolAnswer(f"Error: {name} {err.text}", "timeout" if err.kind == "timeout" else "error")

    def next_message(self) -> tuple[str | None, str | None]:
        if self.stopped is not None:
            return None, None
        try:
            return self.process.ask(("next",), self.limit_s)
        except Raised as err:
            return None, f"next_message raised {err}"
        except Stopped as err:
            self.stopped = f"its next_message call {err.text}"
            return None, f"next_message {err.text}"

    def rewards(self, names: Sequence[str], getter: str, floors: Mapping[str, float], partial: str | None = None,
                column: str | None = None, completion: list | None = None, keys: bool = False) -> Any:
        """``ToolSession.rewards`` of the instance (``keys``: with the names it gave, None where
        it gave none); where the rollout's own calls stopped the environment, each column's floor
        (no failure)."""
        out, given = None, None
        if self.stopped is None and self.lost is None:
            try:
                answer = self.process.ask(("rewards", names, getter, partial, column, completion, keys), self.limit_s)
                out, given = answer if keys else (answer, None)
            except Raised as err:
                out = failed(names, "error", f"{getter} raised {err}")
            except Stopped as err:
                self._killed(getter, err)
                if self.stopped is None:
                    out = failed(names, "timeout" if err.kind == "timeout" else "error", f"{getter} {err.text}")
        if out is None:
            out = ([(float(floors.get(name, 0.0)), "", "") for name in names] if self.stopped is not None
                   else failed(names, "infra", self.lost))
        return (out, given) if keys else out

    def score(self, name: str, kwargs: dict, limit_s: float, floor: float) -> tuple[float, str, str]:
        """A reward that reads the instance, on this rollout: (value, failure kind, error text);
        the reward's floor where the rollout's own calls stopped the environment."""
        if self.stopped is None and self.lost is None:
            try:
                return float(self.process.ask(("score", name, kwargs), limit_s)), "", ""
            except Raised as err:
                return math.nan, "error", str(err)
            except Stopped as err:
                self._killed(name, err)
                if self.stopped is None:
                    return math.nan, "timeout" if err.kind == "timeout" else "error", f"{name} {err.text}"
        if self.stopped is not None:
            return float(floor), "", ""
        return math.nan, "infra", self.lost

    def _killed(self, reader: str, err: Stopped) -> None:
        """Reading the rewards killed the process (or it ended): the rollout's doing where its
        calls had left work running, else the read's own failure."""
        if self.left_work:
            self.stopped = f"{reader} {err.text}, with work the rollout's calls left running"
        else:
            self.lost = f"the environment's process was lost: {reader} {err.text}"


def started(ctx: Any, payload: bytes, limit_s: float, reaper: Any = None) -> tuple[EnvironmentProcess | None, str, str]:
    """A new process (its instance made): (process, "", "") or (None, failure kind, why): kind
    "infra" where it could not start or its ``__init__`` ran past ``limit_s``, "error" where it
    raised."""
    try:
        return EnvironmentProcess(ctx, payload, limit_s, reaper), "", ""
    except Raised as err:
        return None, "error", f"the environment failed to start: {err}"
    except Stopped as err:
        return None, "infra", err.text


def probe(spec: Any, row: Mapping[str, Any], names: Sequence[str], limit_s: float, ctx: Any,
          partial: str | None = None) -> tuple[list[str] | None, str]:
    """The names ``spec``'s class (``EnvironmentSpec``) gives for ``row``, its rewards read right
    after ``reset``, before any tool call, in a process of its own (``ctx``: the multiprocessing
    context): (names, "") or (None, why they could not be read)."""
    if spec.reward_getter is None:
        return None, f"{spec.cls.__name__} has no get_rewards or get_reward"
    process, _, why = started(ctx, payload_of(spec, ()), limit_s)
    if process is None:
        return None, why
    try:
        process.ask(("reset", dict(row)), limit_s)
        columns, keys = process.ask(("rewards", list(names), spec.reward_getter, partial, spec.cls.__name__,
                                     [], True), limit_s)
    except (Raised, Stopped) as err:
        return None, str(err)
    finally:
        process.kill()
    if keys is None:
        return None, next((error for _, _, error in columns if error), "its rewards were not read")
    return list(keys), ""
