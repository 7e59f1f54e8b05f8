"""A sandbox init that breaks on request (test_sandbox's verdict tests), standing in for any
way a program might end a sandbox call early: the real ``_sandbox_init`` with ``run_one``
wrapped. A run whose stdin starts with
  - ``crash-before``: the init raises before that run's program starts;
  - ``crash-during``: the init raises after the program has started (while it runs);
  - ``hang-during``: the init hangs after the program has started;
any other run is the real one.
"""

import importlib.util
import os
import time

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "gdpo_ray", "rewards",
                     "_sandbox_init.py")
_spec = importlib.util.spec_from_file_location("_sandbox_init", _path)
init = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(init)
_real_run_one = init.run_one


def run_one(spec, i, run):
    how = run.get("stdin", "")
    if how.startswith("crash-before"):
        raise RuntimeError("the init broke before the program started")
    if how.startswith(("crash-during", "hang-during")):
        init.start_run(spec, i, run)  # the program is running from here on
        if how.startswith("hang-during"):
            time.sleep(3600)
        raise RuntimeError("the init broke while the program ran")
    return _real_run_one(spec, i, run)


init.run_one = run_one
init.main()
