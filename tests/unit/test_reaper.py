"""``gdpo_ray.reaper``: a worker killed with everything it started, and only that; a reaper that
kills the workers on its list when its owner's input ends."""

import subprocess
import sys
import time
import uuid

from gdpo_ray.reaper import Reaper, kill_tree, start_time
from tests.unit.test_reward_pool import _eventually, _gone, _marked

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
#: a worker as the pool starts one (the leader of its session) that starts a child in its session
#: and one that makes a session of its own: 3 processes with the marker on their command line
WORKER = ("import subprocess, sys, time\n"
          "sleeper = [sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}]\n"
          "subprocess.Popen(sleeper)\n"
          "subprocess.Popen(sleeper, start_new_session=True)\n"
          "time.sleep(600)\n")


def worker(marker):
    process = subprocess.Popen([sys.executable, "-c", WORKER.format(marker=marker)], start_new_session=True)
    assert _eventually(lambda: len(_marked(marker)) == 3, 30)
    return process


def test_kill_tree_kills_the_session_and_every_descendant_and_nothing_else():
    marker = f"gdpo-reaper-test-{uuid.uuid4().hex[:8]}"
    bystander = subprocess.Popen(SLEEPER)
    leader = worker(marker)
    started = start_time(leader.pid)
    try:
        assert started is not None
        kill_tree(leader.pid, started + 1)  # another process's start time: its pid was reused
        assert leader.poll() is None and len(_marked(marker)) == 3
        kill_tree(leader.pid, started)
        assert leader.wait(5) == -9 and _eventually(lambda: not _marked(marker), 5)
        assert bystander.poll() is None  # in no tree of the leader's
    finally:
        bystander.kill()
        kill_tree(leader.pid, started)


def test_the_reaper_kills_the_workers_on_its_list_when_its_input_ends():
    first, second = (f"gdpo-reaper-test-{uuid.uuid4().hex[:8]}" for _ in range(2))
    reaper = Reaper()
    one, two = worker(first), worker(second)
    starts = {p.pid: start_time(p.pid) for p in (one, two)}
    try:
        reaper.add(one.pid)
        reaper.add(two.pid)
        reaper.discard(two.pid)  # reaped by its owner: off the list
        time.sleep(0.2)
        assert one.poll() is None and reaper.pid is not None and not _gone(reaper.pid)
        reaper.close()  # as the owner's process ending closes it
        assert one.wait(10) == -9 and _eventually(lambda: not _marked(first) and _gone(reaper.pid), 10)
        assert two.poll() is None and len(_marked(second)) == 3
    finally:
        for pid, started in starts.items():
            kill_tree(pid, started)
