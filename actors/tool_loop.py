"""The steps of multi-turn rollouts (``actors.turn_loop`` runs them): the model generates, the
tools its turn calls run on its rollout's environment, their answers are appended as the chat
template's tool turn, and the model goes on, until it answers without a call, ``max_turns``
turns, or the token budget.

Token in, token out: a trajectory is exactly the tokens the policy sampled plus the tool turns'
tokens (each tool turn tokenized once, on its own); the model's own tokens are never decoded and
encoded again. ``response_mask`` marks which is which (1: sampled; 0: a tool turn's, whose
logprob is 0 and which the learners leave out of the loss).

A rollout whose environment has several user turns (``next_message``) goes on with the next
user message where the model answered without a call, until the environment has none left.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from gdpo_ray.batch import Turns
from gdpo_ray.environments.columns import Schema
from gdpo_ray.environments.process import EnvironmentProcess, Raised, Session, Stopped, payload_of, started
from gdpo_ray.environments.session import ToolAnswer
from gdpo_ray.environments.spec import ROW_COLUMN, VERIFIERS, environment_paths, load_environment
from gdpo_ray.environments.tool_prompt import in_system
from gdpo_ray.environments.tool_turns import ToolTurns
from gdpo_ray.forks import fork_context
from gdpo_ray.reaper import Reaper, left_behind
from gdpo_ray.rewards import NOT_APPLICABLE
from gdpo_ray.tool_format import ToolCall, parse_tool_calls

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Trajectory:
    """One rollout's tokens after the prompt and what happened in it."""

    session: Session | None  # None: the environment failed to start (its rewards are NaN), or released
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)  # 1: sampled by the policy
    messages: list[dict] = dataclasses.field(default_factory=list)  # the completion, as TRL passes it
    finish_reason: str = "stop"
    done: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # failed calls of any kind, timeouts included
    tool_timeouts: int = 0  # calls killed at generation.tool_timeout
    failed: tuple[str, str] | None = None  # the environment failed to start: (kind, error text)
    schemas: list[dict] | None = None  # this rollout's tools, where they depend on its row
    environment: str | None = None  # its class's name in TRL's dict form (None: the one class)
    origin: str = "a rollout"  # which rollout, for the errors that name it (its row's prompt)
    # per token the policy version that sampled it (streaming engines; a tool turn's tokens take
    # the version of the token before them); empty where the engine gives none
    versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:  # as an engine's Sample names them
        return self.tokens

    def append(self, tokens: Sequence[int], logprobs: Sequence[float] | None,
               versions: Sequence[int] | None = None) -> None:
        """Sampled tokens with their logprobs (and versions), or (``logprobs`` None) a tool turn's."""
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens) if logprobs is None else logprobs
        self.mask += [0 if logprobs is None else 1] * len(tokens)
        if versions is not None:
            self.versions += versions
        elif self.versions:
            self.versions += [self.versions[-1]] * len(tokens)


def take_turn(t: Trajectory, sample: Any, budget: int, max_turns: int, tokenizer: Any) -> tuple[str, list] | None:
    """Appends one sampled turn to ``t`` (cut at the budget, as if the engine stopped there); ->
    ("call", its tool calls) to run, ("ask", []) for the environment's next user message, or
    None: the rollout is over."""
    keep = budget - len(t.tokens)
    versions = getattr(sample, "versions", None)
    t.append(sample.token_ids[:keep], sample.logprobs[:keep], None if versions is None else versions[:keep])
    t.turns += 1
    text = tokenizer.decode(sample.token_ids[:keep], skip_special_tokens=True)
    t.messages.append({"role": "assistant", "content": text})
    calls = parse_tool_calls(text) if t.session is not None else []
    if len(sample.token_ids) > keep or sample.finish_reason != "stop":
        t.finish_reason, t.done = "length" if len(sample.token_ids) > keep else sample.finish_reason, True
    elif t.turns >= max_turns:
        t.done = True
    elif calls:
        return "call", calls
    elif t.session is not None and t.session.converses:
        return "ask", []
    else:
        t.done = True
    return None


def answered(t: Trajectory, calls: Sequence[Any], answers: Sequence[ToolAnswer], tool_turns: ToolTurns,
             budget: int) -> None:
    """The answers of a turn's calls appended as the template's tool turn (not where it does not
    fit: the rollout then ends with finish reason ``length``)."""
    t.tool_calls += len(calls)
    t.tool_errors += sum(a.kind is not None for a in answers)
    t.tool_timeouts += sum(a.kind == "timeout" for a in answers)
    named = [(c.name if isinstance(c, ToolCall) else "", a.text) for c, a in zip(calls, answers)]
    ids = tool_turns.ids(named)
    if len(t.tokens) + len(ids) >= budget:  # no room for the answers and a turn after them: rolled back
        t.finish_reason, t.done = "length", True
        return
    t.messages += [{"role": "tool", "name": name, "content": text} for name, text in named]
    t.append(ids, None)


def next_message(t: Trajectory, text: str | None, failure: str | None, tool_turns: ToolTurns,
                 budget: int) -> None:
    """The environment's next user message appended (an environment with several user turns);
    None ends the rollout (a failure of ``next_message`` is counted as a tool error)."""
    if failure is not None:
        t.tool_errors += 1
        t.tool_timeouts += "did not return" in failure
    if text is None:
        t.done = True
        return
    ids = tool_turns.user_ids(text)
    if len(t.tokens) + len(ids) >= budget:
        t.finish_reason, t.done = "length", True
        return
    t.messages.append({"role": "user", "content": text})
    t.append(ids, None)


#: threads waiting on environment processes (each wait bounded by ``generation.tool_timeout``;
#: started as calls need them): as many as the rollouts one actor has in flight, so that no tool
#: call queues behind another's while the engine decodes (a streaming actor's slots, a batched
#: call's prompts_per_call x group_size)
ENV_THREADS = 256
#: idle environment processes kept per class for later rollouts (the rest are ended): this many,
#: or as many as were alive at once (a call of 128 rollouts keeps 128: forking half of them again
#: each call cost a third of the multi-turn throughput, benchmarks/agent.py)
MAX_IDLE = 64


class ToolEnvironment:
    """A rollout actor's environment classes (``data.tool_environment``: one, or TRL's dict form,
    each row naming its class in its ``environment`` column) and what its multi-turn rollouts
    need: the tool turns' template, the turn limit, the tools' time limit, and whether the tools
    are written into the system message (``tools_in_system_prompt``:
    ``gdpo_ray.environments.tool_prompt``).

    Each rollout's instance lives in a process of its own (``gdpo_ray.environments.process``),
    which runs every call of the environment's code and is killed when one runs past
    ``timeout_s``. Instances are made once and reset often, as TRL pools them: a rollout's
    process serves a later rollout of its class once its rewards are read (``release``), unless
    it was killed or failed to reset. ``readers``: the rewards that read the instances (TRL's
    ``environments=``), run in the rollouts' processes; ``floors``: each column's value where the
    rollout's own call stopped its environment (``RewardSpec.floor``).

    An environment that cannot start (its process, ``__init__`` or ``reset`` past the limit) is
    an infrastructure failure: the rollout's environment rewards are NaN (kind ``infra``), said
    once, and the class (``__init__``) or the row (``reset``) is not tried again until the next
    step (``new_step``)."""

    def __init__(self, setting: str | Mapping[str, str], tokenizer: Any, max_turns: int, timeout_s: float,
                 tools_in_system_prompt: str = "auto", readers: Sequence[Any] = (),
                 floors: Mapping[str, float] | None = None) -> None:
        self.specs = {name: load_environment(path, timeout_s) for name, path in environment_paths(setting).items()}
        self.tool_turns, self.max_turns, self.timeout_s = ToolTurns(tokenizer), max_turns, timeout_s
        self.in_system = in_system(tools_in_system_prompt, tokenizer)
        self.readers, self.floors = list(readers), dict(floors or {})
        self._ctx = fork_context(preloaded_modules(setting))
        self._payloads = {name: payload_of(spec, self.readers) for name, spec in self.specs.items()}
        self.pool = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="gdpo-env")
        self._idle: dict[str | None, list[EnvironmentProcess]] = {name: [] for name in self.specs}
        self._processes: set[EnvironmentProcess] = set()  # every one not yet ended
        self._peak = 0  # the most processes alive at once (how many idle ones later calls will want)
        self._down: dict[tuple, str] = {}  # (class,) or (class, row): why it could not start, this step
        self._gives: dict[str, set[str]] = {}  # TRL's dict form: the columns each class has given
        self._schema: Schema | None = None  # the names the classes' rewards give (``rewards``' first call)
        self._lock = threading.Lock()
        self._reaper = Reaper()  # kills the processes where this process ends without ``close``

    @property
    def schemas(self) -> list[dict]:
        """The tools every rollout has (none where they depend on the row: ``schemas_of``)."""
        return list(self.specs[None].schemas) if None in self.specs else []

    def schemas_of(self, t: Trajectory) -> list[dict]:
        """The tools of ``t``'s rollout, for its prompt."""
        return self.schemas if t.schemas is None else t.schemas

    def start(self, rows: Sequence[Mapping[str, Any]]) -> list[tuple[Trajectory, str | None]]:
        """``start_one`` of each row, on the environments' threads."""
        return list(self.pool.map(self.start_one, rows))

    def start_one(self, row: Mapping[str, Any]) -> tuple[Trajectory, str | None]:
        """A fresh (or released) instance reset with ``row``: (trajectory, the text ``reset``
        returned). An instance that cannot be made or reset gives a trajectory without tools
        whose environment rewards are NaN with the error."""
        row, name = dict(row), None
        if None not in self.specs:  # TRL's dict form: the row names its class (not passed to reset)
            name = row.pop(ROW_COLUMN, None)
            if name not in self.specs:
                return Trajectory(None, failed=("error", f"the row's {ROW_COLUMN!r} is {name!r}, not one of "
                                                         f"data.tool_environment's {sorted(self.specs)}")), None
        spec, key = self.specs[name], _row_key(row)
        label = spec.cls.__name__
        down = self._down.get((name,)) or self._down.get((name, key))
        if down is not None:
            return Trajectory(None, failed=("infra", down), environment=name), None
        origin = f"a rollout of the row whose prompt is {_short(row.get('prompt'))}"
        with self._lock:
            process = self._idle[name].pop() if self._idle[name] else None
        if process is None:
            process, kind, why = started(self._ctx, self._payloads[name], self.timeout_s, self._reaper)
            if process is None:
                if kind == "infra":
                    why = f"environment {label}: {why}"
                    self._trip((name,), why)
                return Trajectory(None, failed=(kind, why), environment=name), None
            with self._lock:
                self._processes.add(process)
                self._peak = max(self._peak, len(self._processes))
        try:
            observation, schemas = process.ask(("reset", row), self.timeout_s)
        except Raised as err:
            self._end(process)
            return Trajectory(None, failed=("error", f"the environment failed to start: reset raised {err}"),
                              environment=name, origin=origin), None
        except Stopped as err:
            self._end(process)
            why = f"environment {label}: reset {err.text}"
            self._trip((name, key), why)
            return Trajectory(None, failed=("infra", why), environment=name, origin=origin), None
        schemas = schemas if spec.dynamic else None if name is None else list(spec.schemas)
        return Trajectory(Session(process, self.timeout_s, spec.converses), schemas=schemas,
                          environment=name, origin=origin), observation

    def _trip(self, key: tuple, why: str) -> None:
        with self._lock:
            if key in self._down:
                return
            self._down[key] = why
        logger.warning("%s: its rollouts' environment rewards are NaN (infra), and it is not tried again "
                       "until the next step", why)

    def new_step(self) -> None:
        """Environments that could not start are tried again."""
        with self._lock:
            self._down.clear()

    def rewards(self, trajectories: Sequence[Trajectory], names: Sequence[str]) -> dict[str, tuple]:
        """The environments' columns ``names`` (the ``fn: environment`` ones) over the rollouts,
        as ``RewardPool.score`` takes them (in the dict form, a column that a rollout's class does
        not give does not apply to it). Each getter taking ``completion`` gets its rollout's
        messages. Raises ``columns.SchemaError`` where the names a rollout's rewards gave are not
        ``names`` (in the dict form: not within them, or not its class's first rollout's)."""
        if not names:
            return {}
        if self._schema is None or self._schema.declared != list(names):
            self._schema = Schema(names, partial=None not in self.specs)
        _mark_left_work(trajectories)
        per_rollout = list(self.pool.map(lambda t: self._rewards(t, names), trajectories))
        return _columns(names, per_rollout)

    def _rewards(self, t: Trajectory, names: Sequence[str]) -> list[tuple[float, str, str]]:
        if t.environment is None:  # the one class (or a row naming none of the dict form's)
            if t.failed is not None:
                return [(float("nan"), *t.failed)] * len(names)
            spec = self.specs[None]
            return self._read(t, spec, names, t.session.rewards(names, spec.reward_getter, self.floors,
                                                                completion=t.messages, keys=True))
        spec = self.specs[t.environment]
        if spec.reward_getter is None:
            return [(float("nan"), NOT_APPLICABLE, f"a rollout of {t.environment!r}, which has no reward")] * len(names)
        if t.failed is not None:
            out = [(float("nan"), *t.failed)] * len(names)
        else:
            out = self._read(t, spec, names, t.session.rewards(names, spec.reward_getter, self.floors,
                                                               partial=t.environment, column=spec.cls.__name__,
                                                               completion=t.messages, keys=True))
        gives = self._gives.setdefault(t.environment, {spec.cls.__name__} if spec.reward_getter == "get_reward" else set())
        if t.failed is None and t.session.stopped is None:  # read: the columns its class gives
            gives.update(name for name, (_, kind, _) in zip(names, out) if kind != NOT_APPLICABLE)
        elif gives:  # not read: the columns of other classes do not apply to it either
            out = [o if name in gives else (float("nan"), NOT_APPLICABLE, f"a rollout of {t.environment!r}, which "
                                            f"gives no {name!r}") for name, o in zip(names, out)]
        return out

    def _read(self, t: Trajectory, spec: Any, names: Sequence[str], answer: tuple) -> list:
        """A rollout's columns, once the names its rewards gave (where they gave any) pass the
        schema check."""
        out, keys = answer
        if keys is not None:
            self._schema.check(spec.cls.__name__, keys, t.origin)
        return out

    def read(self, trajectories: Sequence[Trajectory], rows: Sequence[dict],
             limits: Mapping[str, float]) -> dict[str, tuple]:
        """The rewards that read the instances (``readers``), each called on one rollout in its
        process with its keywords ``rows[i]`` (lists of one), within ``limits[name]``; as
        ``rewards`` gives columns. A rollout whose environment failed to start: NaN, its failure."""
        names = [s.name for s in self.readers]
        if not names:
            return {}
        _mark_left_work(trajectories)

        def one(t: Trajectory, kwargs: dict) -> list[tuple[float, str, str]]:
            if t.failed is not None:
                return [(float("nan"), *t.failed)] * len(names)
            return [t.session.score(name, kwargs, limits[name], self.floors.get(name, 0.0)) for name in names]

        return _columns(names, list(self.pool.map(one, trajectories, rows)))

    def release(self, trajectories: Sequence[Trajectory]) -> None:
        """The processes of finished rollouts, for later rollouts; not one that was stopped or
        lost (its instance's state is unknown), nor one running work a call left behind (a
        thread, a process of its own: a later rollout would carry it)."""
        sessions = [(t.environment, t.session) for t in trajectories if t.session is not None]
        for t in trajectories:
            t.session = None
        kept = [(name, s) for name, s in sessions if s.stopped is None and s.lost is None and s.process.idle]
        busy = left_behind(s.process.process.pid for _, s in kept)
        for name, session in sessions:
            process = session.process
            if (name, session) in kept and process.process.pid not in busy and len(self._idle[name]) < max(
                    MAX_IDLE, self._peak):
                with self._lock:
                    self._idle[name].append(process)
            else:
                self._end(process)

    def _end(self, process: EnvironmentProcess) -> None:
        process.kill()  # at once, with its tree: a process that ended first would leave its orphans to init
        with self._lock:
            self._processes.discard(process)

    @staticmethod
    def turns(trajectories: Sequence[Trajectory], prompt_ids: Sequence[list[int]]) -> Turns:
        return Turns([t.mask for t in trajectories], [t.turns for t in trajectories],
                     [t.tool_calls for t in trajectories], [t.tool_errors for t in trajectories],
                     [t.tool_timeouts for t in trajectories], [list(p) for p in prompt_ids])

    def close(self) -> None:
        """Ends every environment process, idle or not (a rollout still running is cut off)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            processes, self._processes = list(self._processes), set()
            self._idle = {name: [] for name in self.specs}
        for process in processes:
            process.kill()
        self._reaper.close()


def preloaded_modules(setting: str | Mapping[str, str]) -> list[str]:
    """What an environment process runs (the fork server imports it before any process forks:
    ``gdpo_ray.forks.fork_context``)."""
    paths = environment_paths(setting).values()
    return ["gdpo_ray.environments.process", *("gdpo_ray.environments.verifiers_env" if p.startswith(VERIFIERS)
                                               else p.split(":")[0] for p in paths if not p.startswith("__main__:"))]


def _mark_left_work(trajectories: Sequence[Trajectory]) -> None:
    """Before their rewards are read: whether each rollout's calls left work running (a read
    that then fails is the rollout's doing: ``Session``)."""
    live = {t.session.process.process.pid: t.session for t in trajectories
            if t.session is not None and t.session.called and t.session.process.alive}
    for pid in left_behind(live):
        live[pid].left_work = True


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _row_key(row: Mapping[str, Any]) -> str:
    return repr(sorted(row.items(), key=lambda item: str(item[0])))[:10_000]


def _columns(names: Sequence[str], per_rollout: Sequence[list]) -> dict[str, tuple]:
    return {name: tuple(list(col) for col in zip(*(r[k] for r in per_rollout))) for k, name in enumerate(names)}


def with_observation(prompt: str | list, observation: str | None) -> str | list:
    """The prompt with ``reset``'s text appended to its last message (TRL's rule: no separator)."""
    if not observation:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]
