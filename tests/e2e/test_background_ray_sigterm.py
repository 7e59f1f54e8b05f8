"""SIGTERM to `gdpo-ray train` while its local Ray, started on a thread of its own, is up and the
run is still being checked (a demo model's warm start; issue 50): the run's own handler
(``StopSignals``) stops it with its short message and status 143. Ray's driver used to put
abseil's failure handler on SIGTERM from that thread: a C stack dump ("*** SIGTERM received"),
then an abort 3 s later, cutting the clean stop short."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the order of `gdpo-ray train`: its handlers, then Ray on a thread while the run is checked
SCRIPT = """
import sys, time
from gdpo_ray.run.cluster import BackgroundRay
from gdpo_ray.run.train import Interrupted, StopSignals

stop = StopSignals()
stop.install()
ray = BackgroundRay(1)
try:
    ray.wait()
    print("up", flush=True)
    time.sleep(120)  # the start-up check (a warm start) runs here when SIGTERM comes
except Interrupted as err:
    print(f"stopped by {err.signum}", file=sys.stderr, flush=True)
    sys.exit(128 + err.signum)
finally:
    ray.stop()
"""


def test_sigterm_with_ray_up_on_a_thread_is_the_runs_own_stop():
    ray_tmp = tempfile.mkdtemp(prefix="gr-")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "up\n", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 143, err[-3000:]  # not 134: no abort
    assert "stopped by 15" in err and "*** SIGTERM received" not in err, err[-3000:]
