"""A Ray actor's reward pool leaves no process behind when the actor is killed mid-call (as a run's
end kills its rollout actors while a reward sleeps): issue 50's 52 orphaned processes."""

import os
import threading
import time
import uuid

import psutil

from tests.unit.test_reward_pool import _eventually, _gone, _marked


class PoolHolder:
    """A rollout actor's part that matters here: a reward pool scoring on a thread of its own."""

    def start(self, marker: str) -> dict:
        from actors.reward import RewardPool

        self.pool = RewardPool([{"name": "sleepy", "fn": "tests.unit.pool_rewards:sleep_forever_on_odd",
                                 "timeout_s": 600}], num_workers=2, rows_per_call=1)
        rows = ["1", "3", "2", "5"]
        threading.Thread(target=self.pool.score, args=([""] * 4, rows, {"marker": [marker] * 4}), daemon=True).start()
        deadline = time.monotonic() + 60
        while len(_marked(marker)) < 3 and time.monotonic() < deadline:  # the 3 odd rows sleep, their children too
            time.sleep(0.05)
        me = psutil.Process()
        return {"pid": os.getpid(), "reaper": self.pool._reaper.pid,
                "descendants": [p.pid for p in me.children(recursive=True)]}


def test_a_killed_actors_reward_workers_and_everything_they_started_are_reaped(ray_cluster):
    marker = f"gdpo-pool-test-{uuid.uuid4().hex[:8]}"
    holder = ray_cluster.remote(num_cpus=0.5)(PoolHolder).remote()
    seen = ray_cluster.get(holder.start.remote(marker), timeout=120)
    assert len(_marked(marker)) == 3  # each in a session of its own: not the actor's descendants' group
    ray_cluster.kill(holder)
    # the workers (parked calls' stand-ins included), the children that left their sessions, the
    # fork server and the reaper: none is left
    assert _eventually(lambda: _gone(seen["pid"]) and all(_gone(pid) for pid in seen["descendants"])
                       and _gone(seen["reaper"]) and not _marked(marker), 20), (
        seen, [pid for pid in seen["descendants"] if not _gone(pid)], _marked(marker))
