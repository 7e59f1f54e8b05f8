"""BFCL's own multi-turn evaluation over JSON lines (run by tests/unit/test_bfcl_multi_turn.py in
.venv-bfcl, built by scripts/test-bfcl-checker.sh). Each stdin line is one case, each stdout
line its answer:

- ``{"kind": "check", "id", "result"}``: the verdict of bfcl-eval's eval runner on a model
  result in BFCL's result layout (``_evaluate_single_multi_turn_entry``: its turn-count checks,
  its dropping of empty steps, then ``multi_turn_checker``) -> ``{"valid", "error_type"}``;
- ``{"kind": "execute", "id", "calls"}``: ``execute_multi_turn_func_call`` on the item's fresh
  state -> the results (strings);
- ``{"kind": "docs", "id"}``: the item's function docs as BFCL's ``load_dataset_entry`` makes
  them -> ``{"function", "missed_function"}``.

The model's steps are already call strings (the layout the suite scores), so the handler's
decoding is the identity on a list of strings and fails on anything else (a failed decoding is
skipped by BFCL's runner, as for any model). BFCL keeps each item's API instances in a module
global named after the model and the item, for the turns of one evaluation: every case gets a
model name of its own, and its instances are dropped once it is answered.
"""

import copy
import json
import os
import sys
import tempfile

# bfcl-eval makes result/, score/ and .file_locks/ under its project root when imported
os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl-root-"))

from bfcl_eval.eval_checker import eval_runner  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry  # noqa: E402

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")


class CallStrings:
    """A handler whose model output is already BFCL's executable call strings."""

    def decode_execute(self, result, has_tool_call_tag):
        if not isinstance(result, list) or not all(isinstance(c, str) for c in result):
            raise ValueError("not a list of call strings")
        return result


def main() -> None:
    entries = {e["id"]: e for c in CATEGORIES for e in load_dataset_entry(c)}
    answers = {a["id"]: a["ground_truth"] for c in CATEGORIES for a in load_ground_truth_entry(c)}
    handler = CallStrings()
    for number, line in enumerate(sys.stdin):
        case = json.loads(line)
        entry = entries[case["id"]]
        category = case["id"].rsplit("_", 1)[0]
        model = f"case{number}"
        if case["kind"] == "check":
            verdict = eval_runner._evaluate_single_multi_turn_entry(
                handler, case["id"], case["result"], answers[case["id"]], copy.deepcopy(entry), model, category)
            out = {"valid": bool(verdict["valid"]),
                   "error_type": "" if verdict["valid"] else verdict["error"]["error_type"]}
        elif case["kind"] == "execute":
            out, _ = multi_turn_utils.execute_multi_turn_func_call(
                case["calls"], entry["initial_config"], entry["involved_classes"], model, case["id"],
                long_context="long_context" in category or "composite" in category)
        else:
            out = {"function": entry["function"], "missed_function": entry.get("missed_function", {})}
        for name in [n for n in vars(multi_turn_utils) if n.startswith(model + "_")]:
            del vars(multi_turn_utils)[name]
        sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
