"""The Arrow record of one prompt group (DESIGN.md §3), what a rollout call reports beside it
(``CallMeta``). Pure: no Ray (``gdpo_ray.groups`` holds the references into the object store,
the metadata the driver reads in their place, and the payload's readers).

One group of G rollouts = G contiguous rows; an object in Ray's store holds one RecordBatch with
one or more whole groups (each a zero-copy slice). Columns (names are the contract):

    prompt_id           string                       the dataset prompt
    group_id            string                       this group (a prompt may be re-issued)
    sample_index        int32                        j in 0..G-1
    prompt_token_ids    list<int32>                  the prompt as the engine saw it
    response_token_ids  large_list<int32>            generated tokens
    response_logprobs   large_list<float32>          log p of each sampled token, logits / T
    response_length     int32                        tokens in the response
    finish_reason       string                       "stop" | "length" | "abort"
    policy_version      int64                        the oldest policy version that sampled a
                                                     token of the group (admission, staleness)
    response_versions   list<struct<version: int32,  the policy versions that sampled the response,
                             tokens: int32>>         as runs over its tokens in order: run (v, n) =
                                                     n tokens sampled by version v (a streaming
                                                     engine's weights change in flight; batch
                                                     engines: one run, (policy_version, length));
                                                     ``token_versions`` expands them per token
    rewards             fixed_size_list<float32>[K]  NaN = could not be computed
    reward_errors       list<string>                 K strings, "" where computed
    ...task columns (e.g. ground_truth), one value per row

Multi-turn rollouts (a tool environment) add, after ``reward_errors`` (``TURN_COLUMNS``):

    response_mask       large_list<int8>             per token: 1 = sampled by the policy, 0 = a
                                                     tool turn's or the template's (out of the loss
                                                     and of the token count; its logprob is 0)
    num_turns           int32                        the policy's turns (generations)
    num_tool_calls      int32                        tool calls parsed and run
    tool_errors         int32                        calls that failed (unparsable, unknown tool,
                                                     bad arguments, raised, timed out)
    tool_timeouts       int32                        calls abandoned after generation.tool_timeout

Their rollouts' prompts may differ within a group (an environment's ``reset`` text is appended
to each rollout's prompt): ``prompt_token_ids`` is per row.

Schema metadata: ``gdpo.reward_names`` (JSON list of the K names, in column order) and
``gdpo.sampling`` (JSON of the sampling parameters: temperature, top_p, top_k).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gdpo_ray.kept_out import kept_out

REWARD_NAMES_KEY = b"gdpo.reward_names"
SAMPLING_KEY = b"gdpo.sampling"
FINISH_REASONS = ("stop", "length", "abort")


def arrow_without_pandas() -> None:
    """For a process that has no use for pandas (the actors): pyarrow imports pandas, where it is
    installed, the first time it builds an array from Python or NumPy values, only to ask whether
    they are pandas objects: 0.27 s of start-up and ~40 MiB. Asked here with pandas hidden,
    pyarrow takes it as absent for such questions; an explicit conversion (``to_pandas``) still
    imports it. A no-op where pandas is imported already. (Arrays of an inferred type and
    ``to_numpy`` import it anyway, from pyarrow's C++ layer: the actors' paths give types and
    read with ``as_numpy``.)"""
    with kept_out("pandas"):
        pa.array([0], pa.int8())


def as_numpy(array: pa.Array) -> np.ndarray:
    """``array.to_numpy()``, read-only, without pyarrow's conversion layer (which imports pandas:
    ``arrow_without_pandas``): for a numeric or boolean array without nulls, a view of its buffer
    (zero-copy; booleans unpacked from their bits); anything else through ``to_numpy``."""
    kind, n = array.type, len(array)
    if array.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                                or pa.types.is_boolean(kind)):
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if pa.types.is_boolean(kind):
        if n == 0:
            return np.zeros(0, bool)
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        return bits[array.offset:array.offset + n].astype(bool)
    dtype = np.dtype(kind.to_pandas_dtype())  # NumPy's dtype of an Arrow number (no pandas)
    if n == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype, n, array.offset * dtype.itemsize)


def _plain_type(values: Sequence[Any]) -> pa.DataType | None:
    """The Arrow type pyarrow would infer for values all of one plain Python type (str, int,
    float, bool), given so that it does not infer it (its inference imports pandas:
    ``arrow_without_pandas``); None (inferred) for anything else."""
    kinds = {type(v) for v in values}
    return _PLAIN.get(kinds.pop()) if len(kinds) == 1 else None


_PLAIN = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


_CORE = [
    ("prompt_id", pa.string()),
    ("group_id", pa.string()),
    ("sample_index", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_token_ids", pa.large_list(pa.int32())),
    ("response_logprobs", pa.large_list(pa.float32())),
    ("response_length", pa.int32()),
    ("finish_reason", pa.string()),
    ("policy_version", pa.int64()),
    ("response_versions", pa.list_(pa.struct([("version", pa.int32()), ("tokens", pa.int32())]))),
]
CORE_COLUMNS = [name for name, _ in _CORE] + ["rewards", "reward_errors"]
#: the columns of a multi-turn rollout (see the module docstring)
TURN_COLUMNS = [("response_mask", pa.large_list(pa.int8())), ("num_turns", pa.int32()),
                ("num_tool_calls", pa.int32()), ("tool_errors", pa.int32()), ("tool_timeouts", pa.int32())]


def group_schema(reward_names: Sequence[str], sampling: Mapping[str, Any] | None = None,
                 task_fields: Sequence[pa.Field] = (), multi_turn: bool = False) -> pa.Schema:
    fields = [pa.field(n, t) for n, t in _CORE] + [
        pa.field("rewards", pa.list_(pa.float32(), len(reward_names))),
        pa.field("reward_errors", pa.list_(pa.string())),
        *(pa.field(n, t) for n, t in (TURN_COLUMNS if multi_turn else ())),
        *task_fields,
    ]
    meta = {REWARD_NAMES_KEY: json.dumps(list(reward_names)).encode()}
    if sampling is not None:
        meta[SAMPLING_KEY] = json.dumps(dict(sampling), sort_keys=True).encode()
    return pa.schema(fields, metadata=meta)


def _ragged(rows: Sequence[Sequence], dtype: type, large: bool) -> pa.Array:
    """A list array from per-row sequences (arrays or lists): offsets by cumsum, values copied
    once, straight into a buffer of Arrow's memory pool (which keeps freed pages for reuse, so a
    rollout actor does not page-fault fresh memory for every batch)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    value_type = pa.from_numpy_dtype(dtype)
    values = pa.allocate_buffer(int(offsets[-1]) * np.dtype(dtype).itemsize)
    if len(rows):  # casting as np.asarray(row, dtype) would
        np.concatenate(rows, out=np.frombuffer(values, dtype), casting="unsafe")
    flat = pa.Array.from_buffers(value_type, int(offsets[-1]), [None, values])
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets), flat)


@dataclasses.dataclass
class GroupData:
    """What a rollout actor knows of one group, before it becomes Arrow."""

    prompt_id: str
    group_id: str
    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[Sequence[int]]  # G responses
    response_logprobs: Sequence[Sequence[float]]
    finish_reasons: Sequence[str]
    policy_version: int
    rewards: np.ndarray  # [G, K]
    reward_errors: Sequence[Sequence[str]]  # [G][K]
    task_columns: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    response_versions: Sequence[Sequence[int]] | None = None  # [G][tokens]; None: all policy_version
    turns: "Turns | None" = None  # a multi-turn group's masks and counts; None: single-turn


@dataclasses.dataclass
class Turns:
    """A multi-turn group's ``TURN_COLUMNS``, per rollout."""

    response_mask: Sequence[Sequence[int]]  # [G][tokens]: 1 = sampled by the policy
    num_turns: Sequence[int]
    num_tool_calls: Sequence[int]
    tool_errors: Sequence[int]
    tool_timeouts: Sequence[int]
    prompt_token_ids: Sequence[Sequence[int]] | None = None  # [G]: each rollout's, where they differ


def build_groups(groups: Sequence[GroupData], reward_names: Sequence[str],
                 sampling: Mapping[str, Any] | None = None) -> pa.RecordBatch:
    """Several groups as ONE checked RecordBatch, each group's rows contiguous (a group is then a
    zero-copy slice: see ``group_bounds``). Task column values are broadcast to their G rows."""
    sizes = [len(g.response_token_ids) for g in groups]
    k = len(reward_names)
    responses = [r for g in groups for r in g.response_token_ids]
    prompts = [p for g, n in zip(groups, sizes)
               for p in (g.turns.prompt_token_ids if g.turns and g.turns.prompt_token_ids else [g.prompt_token_ids] * n)]
    task_names = list(groups[0].task_columns) if groups else []
    arrays = [
        pa.array([g.prompt_id for g, n in zip(groups, sizes) for _ in range(n)], pa.string()),
        pa.array([g.group_id for g, n in zip(groups, sizes) for _ in range(n)], pa.string()),
        pa.array(np.concatenate([np.arange(n, dtype=np.int32) for n in sizes])),
        _ragged(prompts, np.int32, large=False),
        _ragged(responses, np.int32, large=True),
        _ragged([lp for g in groups for lp in g.response_logprobs], np.float32, large=True),
        pa.array(np.fromiter((len(r) for r in responses), np.int32, len(responses))),
        pa.array([f for g in groups for f in g.finish_reasons], pa.string()),
        pa.array(np.repeat([g.policy_version for g in groups], sizes).astype(np.int64)),
        _version_runs(groups, sizes),
        pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(
            [np.asarray(g.rewards, np.float32).reshape(n, k) for g, n in zip(groups, sizes)]
        ).reshape(-1)), k),
        pa.array([list(e) for g in groups for e in g.reward_errors], pa.list_(pa.string())),
    ]
    multi_turn = any(g.turns is not None for g in groups)
    if multi_turn:
        if not all(g.turns is not None for g in groups):
            raise ValueError("a batch holds multi-turn groups or single-turn ones, not both")
        turns = [g.turns for g in groups]
        arrays += [_ragged([m for t in turns for m in t.response_mask], np.int8, large=True),
                   *(pa.array(np.concatenate([np.asarray(getattr(t, name), np.int32) for t in turns]))
                     for name, _ in TURN_COLUMNS[1:])]
    task_fields = []
    for name in task_names:
        values = [g.task_columns[name] for g, n in zip(groups, sizes) for _ in range(n)]
        col = pa.array(values, _plain_type(values))
        arrays.append(col)
        task_fields.append(pa.field(name, col.type))
    batch = pa.RecordBatch.from_arrays(arrays, schema=group_schema(reward_names, sampling, task_fields, multi_turn))
    check_groups(batch)
    return batch


def _version_runs(groups: Sequence[GroupData], sizes: Sequence[int]) -> pa.Array:
    """The ``response_versions`` column: each response's per-token versions as runs; a group
    without them (a batch engine's) is one run per response, (policy_version, its length)."""
    lengths = np.fromiter((len(r) for g in groups for r in g.response_token_ids), np.int64, sum(sizes))
    versions = np.repeat([g.policy_version for g in groups], sizes).astype(np.int32)
    counts, tokens = (lengths > 0).astype(np.int32), lengths.astype(np.int32)
    given = [g.response_versions is not None for g in groups]
    if any(given):  # runs of the given per-token versions, row by row
        runs_v, runs_n, counts, row = [], [], [], 0
        for g, n in zip(groups, sizes):
            for j in range(n):
                v, t = _runs(g.response_versions[j]) if g.response_versions is not None else \
                    (versions[row:row + 1], tokens[row:row + 1]) if lengths[row] else (np.zeros(0, np.int32),) * 2
                runs_v.append(v)
                runs_n.append(t)
                counts.append(len(v))
                row += 1
        versions, tokens = np.concatenate(runs_v).astype(np.int32), np.concatenate(runs_n).astype(np.int32)
        counts = np.asarray(counts, np.int32)
    else:
        versions, tokens = versions[lengths > 0], tokens[lengths > 0]
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    runs = pa.StructArray.from_arrays([pa.array(versions, pa.int32()), pa.array(tokens, pa.int32())],
                                      names=["version", "tokens"])
    return pa.ListArray.from_arrays(pa.array(offsets), runs)


def _runs(per_token: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(versions, token counts) of the runs of equal values in ``per_token``."""
    v = np.asarray(per_token, np.int32)
    if not len(v):
        return v, v
    starts = np.concatenate(([0], np.flatnonzero(v[1:] != v[:-1]) + 1))
    return v[starts], np.diff(np.append(starts, len(v))).astype(np.int32)


def token_versions(column: pa.Array) -> np.ndarray:
    """A ``response_versions`` column (or a slice of one) expanded: per token, rows in order,
    the policy version that sampled it."""
    version, tokens = column.flatten().flatten()
    return np.repeat(as_numpy(version), as_numpy(tokens))


def build_group(*, reward_names: Sequence[str], sampling: Mapping[str, Any] | None = None,
                **fields: Any) -> pa.RecordBatch:
    """One group as a checked RecordBatch (fields of ``GroupData``)."""
    return build_groups([GroupData(**fields)], reward_names, sampling)


def reward_names(schema: pa.Schema) -> list[str]:
    meta = schema.metadata or {}
    if REWARD_NAMES_KEY not in meta:
        raise ValueError(f"schema has no {REWARD_NAMES_KEY.decode()} metadata")
    return json.loads(meta[REWARD_NAMES_KEY])


def group_bounds(batch: pa.RecordBatch) -> list[tuple[str, int, int]]:
    """(group_id, first row, end row) of each group of a batch, in order."""
    ids = batch.column("group_id")
    n = len(ids)
    if n == 0:
        return []
    change = as_numpy(pc.not_equal(ids.slice(1), ids.slice(0, n - 1)))
    starts = np.concatenate(([0], np.flatnonzero(change) + 1))
    ends = np.append(starts[1:], n)
    names = pc.take(ids, pa.array(starts)).to_pylist()
    return [(name, int(a), int(b)) for name, a, b in zip(names, starts, ends)]


def check_groups(batch: pa.RecordBatch) -> None:
    """Raises ValueError naming what breaks the contract of DESIGN.md §3 (every group of it)."""
    schema = batch.schema
    names = reward_names(schema)
    for field in group_schema(names, multi_turn="response_mask" in schema.names):
        if field.name not in schema.names:
            raise ValueError(f"group batch lacks column {field.name!r}")
        got = schema.field(field.name).type
        if got != field.type:
            raise ValueError(f"group column {field.name!r} is {got}, must be {field.type}")
    bounds = group_bounds(batch)
    if len({g for g, _, _ in bounds}) != len(bounds):
        raise ValueError("the rows of each group must be contiguous and group ids unique")
    starts = np.array([a for _, a, _ in bounds], np.int64)
    sizes = np.array([b - a for _, a, b in bounds], np.int64)
    if len(sizes) and sizes.min() < 2:
        raise ValueError(f"a group needs >= 2 rollouts; group {bounds[int(sizes.argmin())][0]!r} "
                         f"has {sizes.min()}")
    first_row = np.repeat(starts, sizes)
    idx = as_numpy(batch.column("sample_index"))
    if not np.array_equal(idx, np.arange(batch.num_rows) - first_row):
        raise ValueError("sample_index must count 0..G-1 within each group")
    for col in ("prompt_id", "policy_version"):
        values = batch.column(col)
        if not pc.all(pc.equal(values, pc.take(values, pa.array(first_row)))).as_py():
            raise ValueError(f"all rows of a group share one {col}")
    lengths = as_numpy(batch.column("response_length"))
    ragged = [batch.column(c) for c in ("response_token_ids", "response_logprobs")]
    if not all(np.array_equal(np.diff(as_numpy(c.offsets)), lengths) for c in ragged):
        raise ValueError("response_token_ids, response_logprobs and response_length disagree")
    runs = batch.column("response_versions")
    counts = np.diff(as_numpy(runs.offsets))
    version, tokens = (as_numpy(a) for a in runs.flatten().flatten())
    if np.any(tokens < 1) or not np.array_equal(
            np.bincount(np.repeat(np.arange(len(counts)), counts), tokens, len(counts)), lengths):
        raise ValueError("response_versions and response_length disagree (its runs must count >= 1 "
                         "token each and cover the response)")
    if np.any(version < np.repeat(as_numpy(batch.column("policy_version")), counts)):
        raise ValueError("a token's response_versions is older than its group's policy_version "
                         "(which must be the oldest)")
    if not pc.all(pc.is_in(batch.column("finish_reason"), pa.array(FINISH_REASONS, pa.string()))).as_py():
        bad = set(batch.column("finish_reason").to_pylist()) - set(FINISH_REASONS)
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}; got {sorted(bad)}")
    if "response_mask" in schema.names:
        mask = batch.column("response_mask")
        if not np.array_equal(np.diff(as_numpy(mask.offsets)), lengths):
            raise ValueError("response_mask and response_length disagree")
        if not np.isin(as_numpy(mask.flatten()), (0, 1)).all():
            raise ValueError("response_mask holds only 0 (tool or template token) and 1 (sampled)")
    errors = batch.column("reward_errors")
    if not np.all(np.diff(as_numpy(errors.offsets)) == len(names)):
        raise ValueError(f"reward_errors must hold {len(names)} strings per rollout")


def check_group(batch: pa.RecordBatch) -> None:
    """``check_groups`` for a batch that must hold exactly one group."""
    check_groups(batch)
    if len(group_bounds(batch)) != 1:
        raise ValueError("the batch holds several groups")


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """Seconds a rollout call spent generating and scoring, and when (wall clock, ``time.time()``)
    its last token was generated."""

    generate_s: float
    score_s: float
    finished_at: float | None = None


@dataclasses.dataclass(frozen=True)
class CallMeta:
    """What a rollout call reports beside its record batch (the driver reads only this)."""

    groups: list[Any]  # a gdpo_ray.groups.GroupRef per group (ref None), with its metadata
    filtered: list[tuple[str, str]]  # (group_id, reason) of prompts not generated
    tokens: int = 0  # response tokens generated
    timing: CallTiming | None = None  # None when nothing was generated
    aborted: tuple[str, ...] = ()  # group ids aborted in flight (too stale to train): to re-issue
    judge: dict | None = None  # what its judges did (actors.judging.Judging.take_stats), if it has judges
