#!/usr/bin/env sh
# BFCL's own AST checker in an environment of its own (.venv-bfcl), and the test that proves
# gdpo_ray.bfcl.single_turn's matcher gives its verdict on every possible answer of the Python
# categories and on perturbed answers (tests/unit/test_bfcl.py, marked bfcl); and the same for
# its multi-turn runner and checker against gdpo_ray.bfcl.multi_turn_suite on every ground-truth
# trajectory of the four multi-turn categories and on perturbed ones (tests/unit/test_bfcl_multi_turn.py).
# bfcl-eval's checker module imports every model handler of the leaderboard, and a full
# `pip install bfcl-eval` brings 6.4 GB (torch and CUDA wheels for sentence-transformers) and
# pins numpy 1.26.4: the package goes in without dependencies, then exactly the modules its
# checker's imports need (constraints/bfcl-checker.txt: ~470 MB, under a minute).
set -eu
cd "$(dirname "$0")/.."
python3 -m venv .venv-bfcl
.venv-bfcl/bin/pip install -q --no-deps bfcl-eval==2026.3.23
.venv-bfcl/bin/pip install -q --no-deps -r constraints/bfcl-checker.txt
GDPO_BFCL_PYTHON=.venv-bfcl/bin/python .venv/bin/python -m pytest -m bfcl tests/unit/test_bfcl.py \
    tests/unit/test_bfcl_multi_turn.py "$@"
