"""verifiers environments (Prime Intellect's library, 0.4: ``verifiers.v1``) as gdpo-ray tool
environments, each of their rewards a column of its own.

A verifiers environment is a taskset (its tasks are the rows) whose task class scores a finished
trace with its ``@vf.reward`` methods, the rewards its ``TaskConfig`` plugs, and its plugged
judges; verifiers records each by name with a weight and trains on their weighted sum
(``Trace.reward``). Here each is an ``fn: environment`` column, normalized apart by GDPO, and
the weights are the columns' default weights (a declaration overrides one):

- ``data.tool_environment: verifiers:<taskset id>`` (the id verifiers' own CLI takes: an
  installed package that exports its ``Taskset`` subclass), or a subclass of
  ``VerifiersEnvironment`` naming its ``taskset`` (an id, a ``Taskset`` class or instance) and
  ``taskset_config`` (the fields of the taskset's config), as ``module:Class``;
- ``data.prompts``: the taskset's tasks as rows (``taskset_rows``): ``prompt`` (the task's system
  prompt and prompt as chat messages) and ``vf_task`` (the task's data, verifiers' wire form, as
  JSON: ``reset`` rebuilds the task from it); ``python -m gdpo_ray.environments.verifiers_env
  <taskset id> rows.jsonl [limit]`` writes them;
- tools: the ``@vf.tool`` methods of the task's toolsets (``Task.toolsets``: made anew for each
  rollout, then ``setup`` and ``setup_task``) and of the taskset's shared ones
  (``Taskset.toolsets``: made once per process), named as verifiers' harnesses name them
  (``<server>_<tool>``, bare where ``TOOL_PREFIX`` is None), described, their arguments checked
  and converted by MCP's own server (in the process, no HTTP); during each call their
  ``self.state`` is this rollout's state, the one the task's rewards read as ``trace.state``;
- rewards: the conversation (the task's prompt, then each assistant turn with its tool calls and
  each tool answer) as a verifiers ``Trace``, scored by verifiers' ``Task.score`` (async rewards
  awaited); each reward's unweighted score is its column; a reward that returns keyed scores
  gives its keys (declare them: they are known only once it runs); a rubric judge
  (``RubricJudge``) gives one column per criterion, ``<judge>/<criterion>``, in place of its
  weighted sum (default weight: the judge's weight times the criterion's share). Judges call an
  OpenAI-compatible endpoint (their config's ``base_url``, ``api_key_var``) from the
  environment's process, within ``generation.tool_timeout``.

Refused when the environment loads, naming what: tasks that need a container (``NEEDS_CONTAINER``),
rewards or judges that need a runtime (a ``runtime`` parameter without a default), toolsets at an
external ``url`` and toolsets that register their tools themselves (NeMo-Gym's bridge).
``Task.setup`` and ``Task.finalize`` run with no runtime. Metrics (``@vf.metric``) are not
columns. Harnesses and multi-agent ``Env.run`` are not used: gdpo-ray's rollout loop is the agent.
"""

from __future__ import annotations

import asyncio
import collections.abc
import functools
import inspect
import itertools
import json
import sys
import typing
from typing import Any, Callable, Mapping

import verifiers.v1 as vf
from mcp.server.mcpserver import MCPServer
from verifiers.v1.graph import MessageNode
from verifiers.v1.mcp.server import _call_state  # what a tool's ``self.state`` reads during a call
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.types import content_text
from verifiers.v1.utils.decorators import discover_decorated
from verifiers.v1.utils.generic import concrete_type
from verifiers.v1.utils.loaders import taskset_class, taskset_config_type

from gdpo_ray.tool_format import OPEN, ToolCall, parse_tool_calls

#: the row column holding a task's data (``TaskData`` as JSON)
TASK_COLUMN = "vf_task"

_TASKSETS: dict[type, vf.Taskset] = {}  # per class, once per process
_CLASSES: dict[str, type] = {}  # ``verifiers:<id>``'s class, per id


def load_taskset(source: Any, config: Mapping[str, Any] | None = None) -> vf.Taskset:
    """A taskset from an id (an installed package, as verifiers resolves it), a ``Taskset``
    subclass, or an instance (returned as it is); ``config``: the fields of its config."""
    config = dict(config or {})
    if isinstance(source, vf.Taskset):
        return source
    if isinstance(source, str) and source:
        return taskset_class(source)(taskset_config_type(source).model_validate({**config, "id": source}))
    if inspect.isclass(source) and issubclass(source, vf.Taskset):
        kind = concrete_type(source, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return source(kind.model_validate(config))
    raise ValueError(f"a verifiers environment's taskset is an id (an installed taskset package), a "
                     f"verifiers Taskset subclass or instance; got {source!r}")


def taskset_rows(source: Any, limit: int | None = None, config: Mapping[str, Any] | None = None) -> list[dict]:
    """The first ``limit`` tasks of a taskset (``load_taskset``'s ``source`` and ``config``) as
    ``data.prompts`` rows: ``prompt`` (chat messages: the task's system prompt, then its prompt)
    and ``vf_task`` (its data as JSON)."""
    rows = []
    for task in itertools.islice(load_taskset(source, config), limit):
        rows.append({"prompt": prompt_messages(task.data), TASK_COLUMN: task.data.model_dump_json()})
    return rows


def prompt_messages(data: vf.TaskData) -> list[dict]:
    """A task's system prompt and prompt as chat messages (text only)."""
    if data.prompt is None:
        raise ValueError(f"task {data.idx} has no prompt (the user opens its conversation): gdpo-ray's "
                         "rollouts start from a prompt")
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    for m in data.prompt:
        messages.append({"role": m.role, "content": content_text(m.content) if m.content is not None else ""})
    return messages


def environment_class(taskset_id: str) -> type:
    """``data.tool_environment: verifiers:<taskset_id>``'s class (one per id)."""
    if not taskset_id:
        raise ValueError("data.tool_environment: 'verifiers:' needs a taskset id after it, e.g. "
                         "verifiers:my-taskset (an installed package exporting its Taskset subclass)")
    if taskset_id not in _CLASSES:
        name = f"verifiers:{taskset_id}"
        _CLASSES[taskset_id] = type(name, (VerifiersEnvironment,), {"taskset": taskset_id, "__qualname__": name,
                                                                    "__module__": __name__})
    return _CLASSES[taskset_id]


def _taskset_of(cls: type) -> vf.Taskset:
    if cls not in _TASKSETS:
        _TASKSETS[cls] = load_taskset(cls.taskset, cls.taskset_config)
    return _TASKSETS[cls]


def _first_task(taskset: vf.Taskset) -> vf.Task:
    task = next(iter(taskset), None)
    if task is None:
        raise ValueError(f"the verifiers taskset {type(taskset).__name__} has no task")
    return task


def _needs_runtime(fn: Callable) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _returns_mapping(fn: Callable) -> bool:
    """A reward annotated to return keyed scores (its keys are its columns, known when it runs)."""
    try:
        returned = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: taken for a number
        return False
    return (typing.get_origin(returned) or returned) in (dict, collections.abc.Mapping, typing.Mapping)


def check_task(task: vf.Task, toolsets: list) -> None:
    """What gdpo-ray cannot run, refused with its name (see the module docstring)."""
    kind = type(task).__name__
    if task.NEEDS_CONTAINER:
        raise ValueError(f"verifiers task {kind} needs a container (NEEDS_CONTAINER): gdpo-ray runs a "
                         "task's tools in its environment's process, with no container or sandbox")
    needs = [fn.__name__ for fn in task.hooks("reward") if _needs_runtime(fn)]
    needs += [judge.reward_name for judge in task.plugged_judges() if _needs_runtime(judge.score)]
    if needs:
        raise ValueError(f"verifiers task {kind}: {needs} need a runtime (a `runtime` parameter without a "
                         "default), which gdpo-ray does not provide; give it a default of None")
    for server in toolsets:
        name = type(server).__name__
        if getattr(server.config, "url", None):
            raise ValueError(f"verifiers toolset {name} is served at {server.config.url}: gdpo-ray runs a "
                             "task's toolsets in its environment's process, not external servers")
        if type(server).register is not vf.Toolset.register:
            raise ValueError(f"verifiers toolset {name} registers its tools itself (its own register): "
                             "gdpo-ray runs @vf.tool methods only")


def reward_weights(task: vf.Task) -> dict[str, float]:
    """The columns a task's scoring gives, known before it runs, with verifiers' weights: each
    reward (not those returning keyed scores), each plugged judge (a rubric judge: each criterion)."""
    out = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")
           if not _returns_mapping(fn)}
    for judge in task.plugged_judges():
        criteria = getattr(judge, "criteria", None)
        if criteria:
            total = sum(c.weight for c in criteria)
            out.update({f"{judge.reward_name}/{c.name}": judge.config.weight * c.weight / total for c in criteria})
        else:
            out[judge.reward_name] = float(judge.config.weight)
    return out


class _Tools:
    """A rollout's toolsets behind in-process MCP servers: their schemas as the model sees them,
    and calls by the names it uses, each with ``state`` as the tools' ``self.state``."""

    def __init__(self, servers: list, state_of: Callable[[Any], vf.State]) -> None:
        self.routes: dict[str, tuple[MCPServer, str]] = {}
        self.servers, self.state_of = servers, state_of
        self.mcps = [self._serve(s) for s in servers]

    def _serve(self, server: Any) -> MCPServer:
        mcp = MCPServer(server.server_name or type(server).__name__)
        for fn in discover_decorated(server, "tool"):
            mcp.add_tool(self._bound(server, fn), name=getattr(fn, "tool_name", None) or fn.__name__,
                         description=(fn.__doc__ or "").strip() or None)
        return mcp

    def _bound(self, server: Any, fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            token = _call_state.set(self.state_of(server))
            try:
                value = fn(*args, **kwargs)
                return await value if inspect.isawaitable(value) else value
            finally:
                _call_state.reset(token)

        call.__signature__ = inspect.signature(fn)  # MCP describes the tool's own parameters
        return call

    async def schemas(self) -> list[dict]:
        out, self.routes = [], {}
        for server, mcp in zip(self.servers, self.mcps):
            for tool in await mcp.list_tools():
                name = f"{server.server_name}_{tool.name}" if server.server_name else tool.name
                if name in self.routes:
                    raise ValueError(f"two verifiers tools are named {name!r}: give their toolsets a TOOL_PREFIX")
                self.routes[name] = (mcp, tool.name)
                out.append({"type": "function", "function": {
                    "name": name, "description": tool.description or "", "parameters": tool.input_schema}})
        return out

    async def call(self, name: str, arguments: dict) -> str:
        if name not in self.routes:
            raise ValueError(f"there is no tool {name!r}; the tools are {', '.join(sorted(self.routes))}")
        mcp, raw = self.routes[name]
        result = await mcp.call_tool(raw, arguments)
        text = "\n".join(getattr(block, "text", None) or str(block) for block in result.content)
        if result.is_error:
            raise RuntimeError(text)
        return text


async def _with_state(state: vf.State, coroutine: Any) -> Any:
    token = _call_state.set(state)
    try:
        return await coroutine
    finally:
        _call_state.reset(token)


class VerifiersEnvironment:
    """A verifiers taskset as a gdpo-ray environment (see the module docstring): name it in a
    subclass (``taskset``, ``taskset_config``), or write ``verifiers:<taskset id>``. Its tools are
    per rollout (``tool_schemas``, ``call_tool``); ``get_rewards(completion)`` scores the
    conversation with the task's own scoring."""

    taskset: Any = None  # an id, a verifiers Taskset subclass or instance
    taskset_config: Mapping[str, Any] = {}  # the fields of the taskset's config

    def __init__(self) -> None:
        self._taskset = _taskset_of(type(self))
        self._loop: asyncio.AbstractEventLoop | None = None  # one per instance: the tools' resources live on it
        self._shared: list | None = None  # the taskset's shared toolsets, made at the first reset
        self._task: vf.Task | None = None
        self._trace: vf.Trace | None = None
        self._tools: _Tools | None = None
        task = _first_task(self._taskset)
        check_task(task, [*type(task).toolsets(task.config), *type(self._taskset).toolsets(self._taskset.config)])

    @classmethod
    def reward_columns(cls) -> dict[str, float]:
        """The columns the task's scoring gives (``reward_weights``), with their default weights."""
        return reward_weights(_first_task(_taskset_of(cls)))

    def reset(self, **row: Any) -> None:
        data = row.get(TASK_COLUMN)
        if not isinstance(data, str):
            raise ValueError(f"the row has no {TASK_COLUMN!r} column (the task's data as JSON): make the rows "
                             "with gdpo_ray.environments.verifiers_env.taskset_rows")
        kind = type(self._taskset).task_type()
        task = kind(kind.data_type().model_validate_json(data), self._taskset.config.task)
        state = state_cls(type(task))()
        self._task = task
        self._trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                              hash=task.hash),
                               agent=AgentInfo(config=vf.AgentConfig(), name="gdpo-ray"), state=state)
        if self._shared is None:
            self._shared = type(self._taskset).toolsets(self._taskset.config)
            for server in self._shared:
                self._run(server.setup(), server)
        own = type(task).toolsets(task.config)
        states = {id(s): state if isinstance(state, state_cls(type(s))) else state_cls(type(s))() for s in own}
        for server in own:
            self._run(server.setup(), server, states[id(server)])
            self._run(server.setup_task(task), server, states[id(server)])
        self._tools = _Tools([*own, *self._shared],
                             lambda s: states[id(s)] if id(s) in states else self._shared_state(s))
        self._run(task.setup(self._trace, None))

    def _shared_state(self, server: Any) -> vf.State:
        return self._trace.state if isinstance(self._trace.state, state_cls(type(server))) else state_cls(type(server))()

    def _run(self, coroutine: Any, server: Any = None, state: vf.State | None = None) -> Any:
        if server is not None:
            coroutine = _with_state(state if state is not None else self._shared_state(server), coroutine)
        if self._loop is None:  # made at the first call (not for an instance the start-up checks make)
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)

    def tool_schemas(self) -> list[dict]:
        return self._run(self._tools.schemas())

    def call_tool(self, name: str, arguments: dict) -> str:
        return self._run(self._tools.call(name, arguments))

    def get_rewards(self, completion: list) -> dict[str, float | None]:
        """The task's scoring of the conversation (``completion``: the messages after the prompt),
        each reward by name, unweighted; a rubric judge's criteria in place of its sum."""
        task, trace = self._task, self._trace
        trace.nodes = _nodes(task.data, completion)
        self._run(task.finalize(trace, None))
        self._run(task.score(trace))
        out = {name: None if reward is None else reward.score for name, reward in trace.rewards.items()}
        for judge in task.plugged_judges():
            criteria = getattr(judge, "criteria", None)
            if criteria:
                out.pop(judge.reward_name, None)
                out.update({f"{judge.reward_name}/{c.name}": trace.metrics.get(f"{judge.reward_name}/{c.name}")
                            for c in criteria})
        return out


def _nodes(data: vf.TaskData, completion: list) -> list[MessageNode]:
    """The conversation as a trace's message graph, one branch: the prompt (not sampled), then the
    rollout's messages (assistant turns sampled, their ``<tool_call>`` blocks as tool calls; each
    tool answer linked to its call, in order)."""
    messages: list = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    messages += [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    sampled = [False] * len(messages)
    calls: list[str] = []  # the ids of the last assistant turn's calls, not yet answered
    for i, m in enumerate(completion):
        role, text = m.get("role"), m.get("content") or ""
        if role == "assistant":
            parsed = parse_tool_calls(text)
            ids = [f"call_{i}_{k}" for k in range(len(parsed))]
            tool_calls = [vf.ToolCall(id=c_id, name=c.name, arguments=json.dumps(c.arguments))
                          for c_id, c in zip(ids, parsed) if isinstance(c, ToolCall)]
            content = text.split(OPEN, 1)[0].strip() if parsed else text
            messages.append(vf.AssistantMessage(content=content, tool_calls=tool_calls or None))
            calls, sampled = ids, sampled + [True]
        elif role == "tool":
            messages.append(vf.ToolMessage(content=text, name=m.get("name") or None,
                                           tool_call_id=calls.pop(0) if calls else f"call_{i}"))
            sampled.append(False)
        else:
            messages.append(vf.UserMessage(content=text))
            sampled.append(False)
    return [MessageNode(parent=k - 1 if k else None, message=m, sampled=s)
            for k, (m, s) in enumerate(zip(messages, sampled))]


def main(argv: list[str] | None = None) -> None:
    """``python -m gdpo_ray.environments.verifiers_env <taskset id> <rows.jsonl> [limit]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        raise SystemExit("usage: python -m gdpo_ray.environments.verifiers_env <taskset id> <rows.jsonl> [limit]")
    rows = taskset_rows(args[0], int(args[2]) if len(args) == 3 else None)
    with open(args[1], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(f"{len(rows)} rows of {args[0]} -> {args[1]}")


if __name__ == "__main__":
    main()
