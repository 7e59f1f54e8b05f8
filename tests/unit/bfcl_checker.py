"""BFCL's own AST checker over JSON lines (run by tests/unit/test_bfcl.py in .venv-bfcl, built
by scripts/test-bfcl-checker.sh): each stdin line {"functions", "calls", "answer", "category"},
each stdout line the checker's verdict (true/false)."""

import json
import os
import sys
import tempfile

# bfcl-eval makes result/, score/ and .file_locks/ under its project root when imported
os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl-root-"))

from bfcl_eval.constants.enums import Language  # noqa: E402
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker  # noqa: E402

# a model of the leaderboard whose function names keep their dots (underscore_to_dot False)
MODEL = "Qwen_Qwen3-8B"

for line in sys.stdin:
    case = json.loads(line)
    verdict = ast_checker(case["functions"], case["calls"], case["answer"], Language.PYTHON,
                          case["category"], MODEL)
    sys.stdout.write(json.dumps(bool(verdict["valid"])) + "\n")
