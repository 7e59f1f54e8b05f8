"""Environment code in processes that can be killed (gdpo_ray/environments/process.py,
actors/tool_loop.py): whatever a policy's call makes the environment do (raise SystemExit, return
a value whose text cannot be made, hold the GIL in C code, hang, end the process, never finish
its text), the call is answered within the time limit, the rollout goes on, the environment it
stopped scores the column's floor, and no process, thread or instance outlives its limit."""

import math
import os
import threading
import time

import pytest

from actors.tool_loop import ToolEnvironment
from gdpo_ray.tool_format import ToolCall

ENVS = "tests.unit.trl_style_environments"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie: ended, not yet reaped by its parent
    except FileNotFoundError:
        return True


def test_every_hostile_call_is_answered_and_only_a_killed_one_stops_the_environment(tokenizer):
    env = ToolEnvironment(f"{ENVS}:Hostile", tokenizer, max_turns=4, timeout_s=1.0, floors={"calls": -1.0})
    try:
        (survivor, _), (spun, _), (crashed, _), (endless, _) = env.start([{}] * 4)
        answers = [survivor.session.call(ToolCall(name, arguments)) for name, arguments in [
            ("leave", {"code": 2}), ("power", {"base": 10, "exponent": 5000}), ("interrupt", {}),
            ("power", {"base": 2, "exponent": 3})]]
        assert [(a.kind, a.text[:40]) for a in answers] == [
            ("error", "Error: SystemExit: 2"), ("error", "Error: ValueError: Exceeds the limit (43"),
            ("error", "Error: KeyboardInterrupt"), (None, "8")]
        start = time.perf_counter()
        spin = spun.session.call(ToolCall("spin", {"n": 10 ** 13}))  # C code holding the GIL
        assert time.perf_counter() - start < 3
        assert (spin.kind, spin.text) == ("timeout", "Error: spin did not return within 1 s (its process was killed)")
        crash = crashed.session.call(ToolCall("crash", {}))
        assert crash.kind == "error" and crash.text == "Error: crash ended its environment's process (exit code 3)"
        text = endless.session.call(ToolCall("endless", {}))  # a result whose text never ends
        assert text.kind == "timeout"
        later = spun.session.call(ToolCall("power", {"base": 2, "exponent": 3}))
        assert later.kind == "error" and later.text.startswith("Error: the environment stopped responding (its spin call")
        # the survivor's instance counted its 3 calls; an environment stopped by its own call: the floor
        columns = env.rewards([survivor, spun, crashed, endless], ["calls"])
        assert columns == {"calls": ([3.0, -1.0, -1.0, -1.0], [""] * 4, [""] * 4)}
        killed = [t.session.process.process.pid for t in (spun, crashed, endless)]
        assert all(gone(pid) for pid in killed)
        kept = survivor.session.process
        env.release([survivor, spun, crashed, endless])
        assert env._idle == {None: [kept]} and env._processes == {kept}
    finally:
        env.close()
    assert gone(kept.process.pid)


def test_an_environment_that_cannot_start_is_an_infrastructure_failure_said_once_per_step(tokenizer, caplog):
    env = ToolEnvironment(f"{ENVS}:SlowStart", tokenizer, max_turns=2, timeout_s=0.5)
    try:
        start = time.perf_counter()
        (first, _), = env.start([{}])
        assert time.perf_counter() - start < 5
        assert first.failed[0] == "infra" and "__init__ did not return within 0.5 s" in first.failed[1]
        start = time.perf_counter()
        (second, _), = env.start([{}])  # not tried again this step
        assert time.perf_counter() - start < 0.1 and second.failed == first.failed
        assert sum("not tried again until the next step" in r.getMessage() for r in caplog.records) == 1
        column = env.rewards([first, second], ["SlowStart"])["SlowStart"]
        assert all(math.isnan(v) for v in column[0]) and column[1] == ["infra", "infra"]
        env.new_step()
        (third, _), = env.start([{}])
        assert third.failed == first.failed and not env._processes
    finally:
        env.close()


def test_a_reset_that_hangs_fails_its_row_not_the_others(tokenizer):
    env = ToolEnvironment(f"{ENVS}:SlowReset", tokenizer, max_turns=2, timeout_s=0.5)
    try:
        (stalled, _), (fine, _), (again, _) = env.start([{"stall": 1}, {"stall": 0}, {"stall": 1}])
        assert stalled.failed[0] == "infra" and "reset did not return within 0.5 s" in stalled.failed[1]
        assert fine.failed is None and fine.session.call(ToolCall("act", {})).text == "ok"
        assert again.failed == stalled.failed
        assert len(env._processes) == 1
    finally:
        env.close()


def test_threads_and_processes_stay_bounded_over_many_killed_calls(tokenizer):
    env = ToolEnvironment(f"{ENVS}:Hostile", tokenizer, max_turns=2, timeout_s=0.3)
    threads = threading.active_count()
    try:
        for _ in range(3):
            started = env.start([{}] * 8)
            list(env.pool.map(lambda t: t[0].session.call(ToolCall("spin", {"n": 10 ** 13})), started))
            env.release([t for t, _ in started])
        assert not env._processes and env._idle == {None: []}
        assert threading.active_count() <= threads + 32  # the pool's threads, none per call
    finally:
        env.close()


def test_the_tool_loop_gives_the_floor_and_counts_what_was_killed(tiny_model_dir):
    import asyncio

    import numpy as np

    from actors.prompts import Prompt
    from actors.rollout import RolloutActor
    from tests.unit.trl_style_environments import HOSTILE

    call = '<tool_call>{"name": "act", "arguments": {}}</tool_call>'
    actor = RolloutActor(tiny_model_dir, [{"name": "acted", "fn": "environment", "floor": -1}], group_size=2,
                         engine="tests.unit.scripted_engine:ScriptedEngine", engine_kwargs={"script": [call, "Done."]},
                         sampling={"max_tokens": 200}, environment=f"{ENVS}:ByRow",
                         max_turns=4, tool_timeout=1, max_prompt_tokens=4096)
    modes = list(HOSTILE)
    try:
        start = time.perf_counter()
        meta, batch = asyncio.run(actor.generate([Prompt(str(i), i, 0, 0, "Act.", {"mode": m})
                                                  for i, m in enumerate(modes)]))
        took = time.perf_counter() - start
        pids = [p.process.pid for p in actor.tools._processes]
    finally:
        asyncio.run(actor.shutdown())
    assert took < 10  # the killed calls ran side by side, each stopped at its 1 s
    acted = batch.column("rewards").flatten().to_numpy()
    floor = {"spin", "hang", "crash", "endless"}
    assert list(acted) == [x for m in modes for x in [-1.0 if m in floor else 1.0] * 2]
    assert all(e == "" for e in batch.column("reward_errors").flatten().to_pylist())  # no reward failure
    timeouts = dict(zip([m for m in modes for _ in range(2)], batch.column("tool_timeouts").to_pylist()))
    assert timeouts == {m: int(m in {"spin", "hang", "endless"}) for m in modes}
    errors = dict(zip([m for m in modes for _ in range(2)], batch.column("tool_errors").to_pylist()))
    assert errors == {m: int(m != "fine") for m in modes}
    assert all(gone(pid) for pid in pids) and not os.path.exists("/proc/self/task/none")


def test_a_class_whose_init_hangs_fails_the_check_before_ray(monkeypatch, capsys):
    from gdpo_ray.run.cli import main
    from gdpo_ray.run.train import TrainingRun

    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))
    start = time.perf_counter()
    assert main(["check", "agent", f"data.tool_environment={ENVS}:HangsOnInit", "generation.tool_timeout=1"]) == 2
    err = capsys.readouterr().err
    assert "HangsOnInit() did not return within 1 s (generation.tool_timeout)" in err and "Traceback" not in err
    assert time.perf_counter() - start < 30


def test_a_floor_is_a_number_on_a_column_read_from_the_environment():
    from gdpo_ray.rewards import RewardSpec, check_specs

    def reads(environments, **kwargs):
        return [1.0] * len(environments)

    check_specs([RewardSpec.from_dict({"name": "state", "fn": "environment", "floor": -1}),
                 RewardSpec(name="reads", fn=reads, floor=0.5)])
    with pytest.raises(ValueError, match="reward 'format': floor applies only to a column read from the rollout's"):
        check_specs([RewardSpec.from_dict({"name": "format", "fn": "tool_turn_format", "floor": -1})])
    with pytest.raises(ValueError, match=r"reward 'state': floor must be a finite number; got nan"):
        check_specs([RewardSpec.from_dict({"name": "state", "fn": "environment", "floor": float("nan")})])


def test_environment_processes_die_with_the_process_that_owns_them(tiny_model_dir):
    import signal
    import subprocess
    import sys

    script = (f"from transformers import AutoTokenizer\n"
              f"from actors.tool_loop import ToolEnvironment\n"
              f"env = ToolEnvironment('{ENVS}:Hostile', AutoTokenizer.from_pretrained({str(tiny_model_dir)!r}), 2, 5.0)\n"
              f"started = env.start([{{}}] * 3)\n"
              f"print(*(p.process.pid for p in env._processes), flush=True)\n"
              f"import time; time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3 and not any(gone(pid) for pid in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids)


def _sleeps(seconds):
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if f.read() == f"sleep\0{seconds}\0".encode():
                        out.append(int(name))
            except OSError:
                pass
    return out


def test_work_a_call_leaves_running_is_the_rollouts_and_never_outlives_it(tokenizer):
    """A read of the rewards broken by work the rollout's calls left running (a thread that ends
    the process, one that holds the GIL) scores the floor; a process carrying such work (threads,
    children, a detached grandchild) is not reused and is killed with all of it."""
    env = ToolEnvironment(f"{ENVS}:LeavesWork", tokenizer, 2, timeout_s=1.0, floors={"done": -1.0})
    modes = ["thread_exit", "thread_spin", "child", "detached", "none"]
    try:
        ts = [t for t, _ in env.start([{"mode": m} for m in modes])]
        assert [t.session.call(ToolCall("act", {})).text for t in ts] == ["ok"] * 5
        time.sleep(0.2)
        assert len(_sleeps(6001)) == 1 and len(_sleeps(6002)) == 1
        assert env.rewards(ts, ["done"]) == {"done": ([-1.0, -1.0, 1.0, 1.0, 1.0], [""] * 5, [""] * 5)}
        kept = ts[4].session.process
        env.release(ts)
        assert env._idle == {None: [kept]} and env._processes == {kept}
        assert _sleeps(6001) == [] and _sleeps(6002) == []
    finally:
        env.close()


def test_a_reader_that_hangs_fails_itself_and_the_later_reads_name_why(tokenizer):
    from gdpo_ray.rewards import RewardSpec

    readers = [RewardSpec(name="hangs", fn="tests.unit.trl_style_environments:hangs"),
               RewardSpec(name="reads", fn="tests.unit.trl_style_environments:reads")]
    env = ToolEnvironment(f"{ENVS}:Calculator", tokenizer, 2, timeout_s=5.0, readers=readers)
    try:
        (t, _), = env.start([{"target": 1}])
        assert t.session.call(ToolCall("add", {"value": 1})).text == "memory = 1"
        columns = env.read([t], [{"completions": [[]]}], {"hangs": 0.5, "reads": 5.0})
        hung, read = columns["hangs"], columns["reads"]
        assert math.isnan(hung[0][0]) and hung[1] == ["timeout"] and "did not return within 0.5 s" in hung[2][0]
        assert math.isnan(read[0][0]) and read[1] == ["infra"]
        assert read[2][0].startswith("the environment's process was lost: hangs did not return within 0.5 s")
    finally:
        env.close()
