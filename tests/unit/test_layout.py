"""The seams of the layout (DESIGN.md §4), checked on every import, those inside functions too:
actors/ and learners/ never import each other (they meet in gdpo_ray/), and the pure modules
import neither of them nor Ray."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ["gdpo_ray/advantages.py", "gdpo_ray/group_layout.py", "gdpo_ray/losses.py", "gdpo_ray/batch.py",
        "gdpo_ray/weights/buckets.py"]


def imported(path: Path) -> set[str]:
    """Top-level package names of every import in a file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package, forbidden", [("actors", "learners"), ("learners", "actors")])
def test_actors_and_learners_never_import_each_other(package, forbidden):
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if forbidden in imported(p)]
    assert offenders == []


def test_pure_modules_import_no_actors_learners_or_ray():
    for name in PURE:
        assert not imported(ROOT / name) & {"actors", "learners", "ray"}, name


def test_the_engine_contract_imports_nothing_else_of_actors():
    tree = ast.parse((ROOT / "actors/engines.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in modules if m.startswith("actors")}
