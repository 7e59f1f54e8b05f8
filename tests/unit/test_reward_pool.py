"""The scoring pool: a reward that hangs, raises or kills its worker costs only its own rows."""

import json
import math
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from actors.reward import RewardPool
from gdpo_ray.rewards import failure_kind

nan = math.nan
MOD = "tests.unit.pool_rewards"


def spec(name, fn, timeout_s=1.0, **kw):
    return {"name": name, "fn": f"{MOD}:{fn}", "timeout_s": timeout_s, **kw}


@pytest.fixture(scope="module")
def pool():
    with RewardPool([spec("echo", "echo"), spec("hang", "hang_on_7"), spec("raise", "raise_on_3"),
                     spec("die", "die_on_5")], num_workers=2, rows_per_call=4) as p:
        yield p


def test_failures_cost_only_their_own_rows(pool):
    marker = f"gdpo-pool-test-{uuid.uuid4().hex[:8]}"
    completions = ["1", "3", "5", "7", "4", "2"]
    out = pool.score([""] * 6, completions, {"marker": [marker] * 6})
    v = out.values
    np.testing.assert_array_equal(v[:, 0], [1, 3, 5, 7, 4, 2])  # echo: every row
    np.testing.assert_array_equal(v[:, 1], [1, 3, 5, nan, 4, 2])  # hang: only row "7" is lost
    np.testing.assert_array_equal(v[:, 2], [10, nan, 50, 70, 40, 20])  # raise: only row "3"
    np.testing.assert_array_equal(v[:, 3], [1, 1, nan, 1, nan, 1])  # die: "5" killed it; "4" is None
    assert out.errors[3][1] == "timeout: no answer after 1 s (process tree killed)"
    assert out.errors[1][2] == "error: RuntimeError: cannot score 3"
    # a dead worker is an infrastructure failure: retried twice, then NaN
    assert out.errors[2][3] == "infra: reward worker died (exit code 9) (3 attempts)"
    assert [failure_kind(e) for e in out.errors[3]] == ["", "timeout", "", ""]
    assert out.errors[4][3] == ""  # None from the function: NaN, not a failure of the machinery
    assert out.metrics["rewards/hang/timeouts"] == 1.0
    assert out.metrics["rewards/raise/errors"] == 1.0
    assert out.metrics["rewards/die/infra_failures"] == 1.0
    assert out.metrics["rewards/die/errors"] == out.metrics["rewards/die/timeouts"] == 0.0
    assert out.metrics["rewards/raise/failure_rate"] == pytest.approx(1 / 6)
    assert out.metrics["rewards/echo/mean"] == pytest.approx(22 / 6)
    assert out.metrics["rewards/echo/std"] == pytest.approx(np.std([1, 3, 5, 7, 4, 2], ddof=1))
    assert out.metrics["rewards/echo/latency_s"] >= 0
    # the hung call's whole process tree was killed
    time.sleep(0.2)
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).stdout == b""
    # the pool goes on scoring with its replaced workers
    again = pool.score(["", ""], ["2", "6"])
    np.testing.assert_array_equal(again.values, [[2, 2, 20, 1], [6, 6, 60, 1]])


def test_conditions_apply_to_stored_values():
    rewards = [spec("pass", "echo"), spec("bonus", "echo", condition={"on": "pass", "min": 2}),
               spec("gated", "raise_on_3", condition={"on": "bonus", "min": 0})]
    with RewardPool(rewards, num_workers=1) as p:
        out = p.score(["", "", ""], ["1", "2", "3"])
    # bonus paid where pass >= 2; gated follows bonus; row "3" of gated could not be computed
    np.testing.assert_array_equal(out.values, [[1, 0, 10], [2, 2, 20], [3, 3, nan]])


def test_bad_config_fails_before_workers_start():
    with pytest.raises(ValueError, match="condition.on must name another reward"):
        RewardPool([spec("a", "echo", condition={"on": "missing", "min": 1})])
    with pytest.raises(ValueError, match="every column needs 2 rows"):
        with RewardPool([spec("a", "echo")], num_workers=1) as p:
            p.score(["", ""], ["1", "2"], {"ground_truth": ["x"]})


TRL = "tests.unit.trl_style_rewards"


def trl(name, **kw):
    return {"name": name, "fn": f"{TRL}:{name}", "timeout_s": 10, **kw}


def test_trl_style_reward_functions_run_unchanged():
    rewards = [trl("length_target"), trl("boxed_equals"), trl("prompt_echo"), trl("token_count"),
               trl("step_seen"), trl("only_some"), trl("no_kwargs"), trl("judged")]
    from gdpo_ray.rewards import TrainerState

    with RewardPool(rewards, num_workers=1, rows_per_call=2) as p:
        out = p.score(["say blue", "say red", "say green"],
                      ["\\boxed{4} blue", "skip red", "4"],
                      {"ground_truth": ["4", "5", "4"], "response_length": [3, 2, 1]},
                      completion_ids=[[1, 2, 3], [4, 5], [6]],
                      trainer_state=TrainerState(global_step=7))
    assert all(e == "" for row in out.errors for e in row), out.errors
    np.testing.assert_array_equal(out.values, [
        [-6, 1, 1, 3, 7, 1, 0, 0.5],
        [-12, 0, 1, 2, 7, nan, 0, 0.5],
        [-19, 0, 0, 1, 7, 1, 1, 0.5]])


def test_conversational_completions_are_messages():
    with RewardPool([trl("think_answer_format"), {"name": "fmt", "fn": "regex",
                                                   "params": {"pattern": "<think>.*</think>.*"}}],
                    num_workers=1) as p:
        chat = [[{"role": "assistant", "content": "<think>a</think><answer>1</answer>"}],
                [{"role": "assistant", "content": "no tags"}]]
        out = p.score([[{"role": "user", "content": "q"}]] * 2, chat)
    np.testing.assert_array_equal(out.values, [[1, 1], [0, 0]])  # built-ins read the messages too


def test_hanging_rows_cost_about_one_timeout_not_one_each():
    # 16 of 32 rows wait forever, 1 worker, timeout 2 s: each hanging call is parked (its
    # timeout runs beside the others') instead of blocking the worker for its 2 s
    with RewardPool([trl("sleep_on_odd", timeout_s=2)], num_workers=1) as p:
        p.score(["p"], ["0"])  # workers started
        out = p.score(["p"] * 32, [str(i) for i in range(32)])
    np.testing.assert_array_equal(out.values[:, 0], [nan if i % 2 else 1 for i in range(32)])
    assert out.metrics["rewards/sleep_on_odd/timeouts"] == 16
    assert p.parked >= 15  # the hanging calls (the last one need not be: nothing waits behind it)


def test_computing_calls_are_not_parked_even_when_the_cpus_are_busy():
    # six processes spin on the machine's cores: a CPU-bound reward gets a fraction of a core
    # (it looks idle by its CPU time) but stays runnable, so it is not taken for a waiting call
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 2))]
    try:
        with RewardPool([trl("busy")], num_workers=1) as p:
            out = p.score(["p"] * 6, ["x"] * 6)
    finally:
        for s in spinners:
            s.kill()
    assert out.values[:, 0].tolist() == [1.0] * 6 and p.parked == 0


def test_infrastructure_failures_are_retried(tmp_path):
    flaky = {"name": "flaky", "fn": f"{MOD}:infra_twice", "params": {"folder": str(tmp_path)},
             "timeout_s": 5}
    down = {"name": "down", "fn": f"{MOD}:infra_always", "timeout_s": 5}
    with RewardPool([flaky, down], num_workers=1) as p:
        out = p.score([""], ["1"])
    assert out.values[0, 0] == 1.0 and out.errors[0][0] == ""  # third attempt worked
    assert out.errors[0][1] == "infra: RewardInfraError: sandbox gone (3 attempts)"
    assert out.metrics["rewards/down/infra_failures"] == 1
    assert out.metrics["rewards/flaky/infra_failures"] == 0


def test_plain_rewards_get_a_call_per_worker_sandboxed_ones_a_row_per_call(tmp_path):
    sizes = {"name": "sizes", "fn": f"{MOD}:call_sizes", "params": {"folder": str(tmp_path)}}
    with RewardPool([sizes], num_workers=2) as p:
        out = p.score(["p"] * 10, ["c"] * 10)
    assert out.values[:, 0].tolist() == [1.0] * 10
    # as TRL calls a reward (once per batch), split among the pool's 2 workers
    assert sorted(int(f.name.split("-")[0]) for f in tmp_path.iterdir()) == [5, 5]
    pool = RewardPool([{"name": "code", "fn": "code_bug"}, sizes], num_workers=1)
    try:
        assert pool._row_by_row == {0}  # the sandboxed reward: one program per call
    finally:
        pool.close()


POOL_IN_A_SCRIPT = """
import json, sys
import psutil
sys.path.insert(0, {root!r})
from actors.reward import RewardPool

def servers():
    return sum("multiprocessing.forkserver" in " ".join(c.cmdline()) for c in psutil.Process().children())

if __name__ == "__main__":  # run as a script, as Ray runs its workers' default_worker.py
    mod = "tests.unit.pool_rewards"
    rewards = [{{"name": n, "fn": f"{{mod}}:{{n}}", "timeout_s": 5}} for n in ("parent_main_ran", "die_on_5")]
    with RewardPool(rewards, num_workers=1) as pool:
        seen = [pool.score([""], ["1"]).values.tolist(), servers()]
        seen += [pool.score([""], ["5"]).values.tolist(), pool.score([""], ["1"]).values.tolist(), servers()]
    print(json.dumps(seen))
"""


def test_workers_start_without_the_parents_script_from_one_fork_server(tmp_path):
    # every worker, a replacement too, forks from the process's one fork server (none is a child
    # of the pool's process: a Ray actor's children are killed with it, before its pool's reaper
    # could kill what they started); no worker re-runs the parent's __main__ script
    script = tmp_path / "driver.py"
    script.write_text(POOL_IN_A_SCRIPT.format(root=os.getcwd()))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, servers_first, killed, after, servers_after = json.loads(out.stdout.splitlines()[-1])
    assert first == [[0.0, 1.0]] and servers_first == 1
    assert killed[0][0] == 0.0 and math.isnan(killed[0][1])  # "5" kills its worker, 3 times
    assert after == [[0.0, 1.0]] and servers_after == 1


def test_any_base_exception_but_keyboard_interrupt_is_the_rewards_failure_on_its_rows():
    # SystemExit, a user's BaseException, GeneratorExit and math-verify's TimeoutException (all
    # BaseExceptions) are the reward's errors on the rows that raise them, never a dead worker
    with RewardPool([spec("base", "base_exceptions", timeout_s=10)], num_workers=1) as p:
        first = p._workers[0].process.pid
        out = p.score([""] * 5, ["ok", "exit", "stop", "generator", "math-verify"])
        assert [w.process.pid for w in p._workers] == [first] and p._workers[0].process.is_alive()
    # the batched call raised: re-scored row by row, so only the 4 rows that raise are lost
    np.testing.assert_array_equal(out.values[:, 0], [1, nan, nan, nan, nan])
    assert [row[0] for row in out.errors] == ["", "error: SystemExit: the reward called sys.exit",
                                              "error: Stop: my own", "error: GeneratorExit",
                                              "error: TimeoutException: Operation timed out!"]
    assert out.metrics["rewards/base/errors"] == 4.0 and out.metrics["rewards/base/infra_failures"] == 0.0
    assert out.metrics["rewards/base/failure_rate"] == pytest.approx(4 / 5)


def _gone(pid):
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _marked(marker):
    return subprocess.run(["pgrep", "-f", marker], capture_output=True).stdout.split()


def _eventually(check, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    return check()


def _new_processes(before):
    """This process's descendants not in ``before``, but multiprocessing's fork server and
    resource tracker (one per process, shared by every pool, ending with it)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            helper = any(h in " ".join(p.cmdline()) for h in ("multiprocessing.forkserver",
                                                               "multiprocessing.resource_tracker"))
            if p.pid not in before and not helper and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_hung_call_is_killed_with_all_it_started_and_close_leaves_no_process():
    import psutil

    marker = f"gdpo-pool-test-{uuid.uuid4().hex[:8]}"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pool = RewardPool([spec("sleepy", "sleep_forever_on_odd", timeout_s=1)], num_workers=2, rows_per_call=1)
    started = [w.process.pid for w in pool._workers]
    add = pool._add_worker

    def recorded():
        worker = add()
        started.append(worker.process.pid)
        return worker

    pool._add_worker = recorded
    try:
        out = pool.score([""] * 4, ["2", "3", "4", "5"], {"marker": [marker] * 4})
        # rows "3" and "5" sleep forever (each after starting a child in a session of its own):
        # they time out; the other rows are scored
        np.testing.assert_array_equal(out.values[:, 0], [2, nan, 4, nan])
        assert out.errors[1][0] == out.errors[3][0] == "timeout: no answer after 1 s (process tree killed)"
        assert out.metrics["rewards/sleepy/timeouts"] == 2.0
        # the two hung workers were killed with the children that left their sessions, and the
        # pool is back to its 2 workers, alive
        now = [w.process.pid for w in pool._workers]
        assert len(now) == 2 and not any(_gone(pid) for pid in now)
        ended = [pid for pid in started if pid not in now]
        assert len(ended) >= 2 and all(_gone(pid) for pid in ended)
        assert _eventually(lambda: not _marked(marker), 5)
        again = pool.score(["", ""], ["2", "4"])
        np.testing.assert_array_equal(again.values[:, 0], [2, 4])
        reaper = pool._reaper.pid
        assert reaper is not None and not _gone(reaper)
    finally:
        pool.close()
    # nothing the pool started is left: no worker, no reaper
    assert all(_gone(pid) for pid in started)
    assert _eventually(lambda: _gone(reaper) and not _new_processes(before), 5), _new_processes(before)
    with pytest.raises(RuntimeError, match="the reward pool was closed"):
        pool.score([""], ["2"])


POOL_KILLED_MID_CALL = """
import json, os, subprocess, sys, threading, time
sys.path.insert(0, {root!r})
from actors.reward import RewardPool

if __name__ == "__main__":
    pool = RewardPool([{{"name": "sleepy", "fn": "tests.unit.pool_rewards:sleep_forever_on_odd",
                        "timeout_s": 600}}], num_workers=2, rows_per_call=1)
    threading.Thread(target=pool.score, args=([""] * 3, ["1", "3", "2"], {{"marker": [{marker!r}] * 3}}),
                     daemon=True).start()
    while len(subprocess.run(["pgrep", "-f", {marker!r}], capture_output=True).stdout.split()) < 2:
        # both calls sleep, their children too
        time.sleep(0.05)
    print(json.dumps({{"workers": [w.process.pid for w in pool._workers], "reaper": pool._reaper.pid}}), flush=True)
    time.sleep(600)
"""


def test_a_pool_whose_process_is_killed_mid_call_leaves_no_process(tmp_path):
    # as a Ray actor is killed at the end of a run while a reward sleeps: none of the pool's code
    # runs; its reaper kills the workers, and the children that left their sessions
    marker = f"gdpo-pool-test-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "owner.py"
    script.write_text(POOL_KILLED_MID_CALL.format(root=os.getcwd(), marker=marker))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        seen = json.loads(owner.stdout.readline())
        assert len(_marked(marker)) == 2 and not any(_gone(pid) for pid in seen["workers"])
    finally:
        owner.kill()
        owner.wait()
    assert _eventually(lambda: all(_gone(pid) for pid in [*seen["workers"], seen["reaper"]])
                       and not _marked(marker)), (seen, _marked(marker))
