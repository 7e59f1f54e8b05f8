"""The floors of the layout (DESIGN.md §4, STYLE.md §14), checked on every import, those inside
functions too:

- the driver (``gdpo_ray/run/``, and ``gdpo_ray/__main__.py``) is the only code that imports
  ``actors/`` or ``learners/``;
- the basement (the rest of ``gdpo_ray/``) imports neither them nor the driver;
- ``actors/`` and ``learners/`` import the basement only, never each other nor the driver;
- ``gdpo_ray/config.py`` (the field table) imports nothing of the project;
- no circle among our modules;
- the pure modules import no Ray.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gdpo_ray", "actors", "learners")
PURE = ["gdpo_ray/advantages.py", "gdpo_ray/normalization.py", "gdpo_ray/group_layout.py", "gdpo_ray/losses.py",
        "gdpo_ray/batch.py", "gdpo_ray/weights/buckets.py", "gdpo_ray/config.py", "gdpo_ray/tool_format.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imported(path: Path) -> set[str]:
    """Every module a file imports (absolute imports, wherever they stand): ``from a.b import c``
    counts as ``a.b.c`` where that is one of our modules, else as ``a.b``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                names.add(full if full in MODULES else node.module)
    return names


def ours(names: set[str]) -> set[str]:
    return {n for n in names if n in MODULES}


GRAPH = {name: ours(imported(path)) - {name} for name, path in MODULES.items()}


def floor(name: str) -> str:
    if name == "gdpo_ray.__main__" or name == "gdpo_ray.run" or name.startswith("gdpo_ray.run."):
        return "driver"
    return "basement" if name.split(".")[0] == "gdpo_ray" else name.split(".")[0]


#: floor -> the floors it may import
ALLOWED = {"driver": {"driver", "basement", "actors", "learners"}, "basement": {"basement"},
           "actors": {"actors", "basement"}, "learners": {"learners", "basement"}}


def test_every_import_points_down_a_floor():
    offenders = [f"{MODULES[a].relative_to(ROOT)} imports {b} ({floor(a)} -> {floor(b)})"
                 for a, targets in sorted(GRAPH.items()) for b in sorted(targets)
                 if floor(b) not in ALLOWED[floor(a)]]
    assert offenders == []


def test_the_field_table_is_a_leaf():
    assert GRAPH["gdpo_ray.config"] == set()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_no_ray(name):
    assert not {n.split(".")[0] for n in imported(ROOT / name)} & {"ray"}, name


def test_the_engine_contract_imports_nothing_else_of_actors():
    assert not {m for m in GRAPH["actors.engines"] if m.startswith("actors")}


def test_importing_the_public_api_and_the_basement_imports_no_ray():
    import subprocess
    import sys

    code = ("import sys, gdpo_ray, gdpo_ray.config, gdpo_ray.advantages, gdpo_ray.rewards, gdpo_ray.eval.suites\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'actors', 'learners')))\n"
            "from gdpo_ray import GDPO, GDPOConfig\n"
            "print(GDPO.__module__, GDPOConfig.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "gdpo_ray.run.algorithm gdpo_ray.run.algorithm"]


def engine_name_comparisons(path: Path) -> list[str]:
    """Comparisons of a value with an engine's name (``x == "vllm"``, ``x in ("hf", "vllm")``)."""
    from actors.engines import ENGINES

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            values = [c.value for s in sides for c in ([s] if isinstance(s, ast.Constant) else
                                                       getattr(s, "elts", [])) if isinstance(c, ast.Constant)]
            if any(v in ENGINES for v in values if isinstance(v, str)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_module_outside_actors_compares_an_engine_name():
    """What the system asks of an engine is its class's traits (actors.engines.EngineTraits) or
    the registry's (generation_mode, digest_variants): a new engine changes actors/ alone."""
    paths = [p for package in ("gdpo_ray", "learners") for p in (ROOT / package).rglob("*.py")]
    assert [hit for p in paths for hit in engine_name_comparisons(p)] == []
    assert engine_name_comparisons(ROOT / "actors" / "rollout.py") == []  # the actor asks the traits too
