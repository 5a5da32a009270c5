"""Import hygiene: no import cycle between dflash_trt modules, and every module imports on its own,
whatever was imported before it.

Static check: an AST walk over every module of the package builds the graph of project imports,
at module top level AND inside functions (a function-level import does not remove a cycle, it
only hides it until the function runs, and then the import order decides whether it breaks), plus
string constants naming a project module (importlib.import_module: cli.py registers its
subcommand modules that way, kernels/ loads its launchers that way). `from pkg import name`
imports pkg.name when that is a module, else pkg itself; importing a.b.c also runs the __init__
of a and a.b, which counts too, except for the importer's own packages (already initialising
when it runs). The graph must have no cycle; a cycle found is printed, edge by edge with line
numbers.

The Triton model-repository templates (serving/model_repo/*/1/model.py) are left out: Triton's
Python backend loads each by file path, `1/` is no importable package, so no module can import
them and they cannot close a cycle; their one import (serving.triton_dflash or triton_text) is
checked as those modules are.

Dynamic check: a fresh interpreter imports every module in a seeded random order (a few seeds),
each import checked on its own. Modules whose optional dependency is absent here (Triton's
Python-backend stub, the Triton compiler) are left out with the reason, listed by the last test.
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_trt"
SEEDS = (0, 1, 2)


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every importable module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if not all(p.isidentifier() for p in parts):  # model_repo/*/1/model.py: see the docstring
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(dotted name, is_from_name) for one import statement; is_from_name: `from pkg import name`."""
    if isinstance(node, ast.Import):
        return [(a.name, False) for a in node.names]
    base = node.module or ""
    if node.level:  # relative import
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    return [(f"{base}.{a.name}", True) for a in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """module -> {imported project module: [line numbers]}, from every import statement anywhere
    in the module (top level or not) and from string constants naming a project module."""
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in modules}

    def add(src: str, dst: str, line: int) -> None:
        if dst != src:
            graph[src].setdefault(dst, []).append(line)

    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        own_packages = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                names = [(node.value, False)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported_names(node, mod, is_package)
            else:
                continue
            for name, from_name in names:
                if name not in modules:
                    if not from_name:
                        continue
                    name = name.rpartition(".")[0]  # `from pkg import attr`: pkg's __init__ itself
                    if name not in modules:
                        continue
                add(mod, name, node.lineno)
                parts = name.split(".")
                for i in range(1, len(parts)):  # the packages around it run their __init__ first
                    parent = ".".join(parts[:i])
                    if parent in modules and parent not in own_packages:
                        add(mod, parent, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, list[int]]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph, or None (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, {})):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, list[int]]]) -> str:
    return "\n".join(
        f"  {a} -> {b}  (line {', '.join(map(str, sorted(set(graph[a][b]))))} of {a})" for a, b in zip(cycle, cycle[1:])
    )


def test_module_list_and_graph_cover_the_package():
    modules = module_files()
    assert {"dflash_trt", "dflash_trt.cli", "dflash_trt.api", "dflash_trt.kernels"} <= set(modules)
    assert not any("model_repo" in m for m in modules)
    graph = import_graph(modules)
    # a function-level import (the serving engine loader) and a string naming a module are edges
    assert "dflash_trt.decoding.engine" in graph["dflash_trt.serving.engine_factory"]
    assert "dflash_trt.train.cli" in graph["dflash_trt.cli"]
    assert "dflash_trt.kernels.accept" in graph["dflash_trt.kernels"]


def test_cycle_finder_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a  # hidden in a function\n    return a\n")
    (pkg / "c.py").write_text("import importlib\nM = importlib.import_module('pkg.a')\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py", "pkg.c": pkg / "c.py"}
    graph = import_graph(modules)
    assert graph["pkg.b"] == {"pkg.a": [2]} and graph["pkg.c"] == {"pkg.a": [2]}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(modules)) is None


def test_no_import_cycle_between_project_modules():
    graph = import_graph(module_files())
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"import cycle (move what both modules need into a module of its own):\n" f"{describe(cycle, graph)}"
    )


# ---- subpackages: a DAG too ---------------------------------------------------------------
# Package-level cycles the graph may still hold, each with the reason and what would end it. A pair here
# drops the second package's edges to the first before the check: nothing else may close a cycle.
ALLOWED_PACKAGE_EDGES = {
    # api.py, the loading facade that deploy/ and serving/ load models through, loads quantized checkpoints
    # through deploy/simulate.py: to end it, those loaders move below api (e.g. modeling/)
    ("api", "deploy"): "api.load_target / load_drafter read quantized checkpoints with deploy/simulate.py",
}


def _package(module: str) -> str:
    """dflash_trt.decoding.engine -> decoding; a top-level module (dflash_trt.api) is its own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, list[str]]]:
    """subpackage -> {subpackage it imports: ["module -> module", ...]} (the package itself left out: its
    __init__ only lists its subpackages)."""
    out: dict[str, dict[str, list[str]]] = {}
    for a, deps in graph.items():
        for b in deps:
            pa, pb = _package(a), _package(b)
            if pa != pb and "dflash_trt" not in (pa, pb):
                out.setdefault(pa, {}).setdefault(pb, []).append(f"{a} -> {b}")
    return out


def test_package_graph_finds_a_package_cycle():
    graph = {"dflash_trt.a.x": {"dflash_trt.b.y": [1]}, "dflash_trt.b.z": {"dflash_trt.a.w": [3]}}
    assert find_cycle(package_graph(graph)) == ["a", "b", "a"]


def test_no_import_cycle_between_subpackages():
    """modeling must not import decoding (decoding runs the models), kernels nothing above them, and so on:
    the subpackages form a DAG, so each can be read, tested and replaced from the bottom up."""
    pgraph = package_graph(import_graph(module_files()))
    for (src, dst), why in ALLOWED_PACKAGE_EDGES.items():
        assert dst in pgraph.get(src, {}), f"allowed edge {src} -> {dst} ({why}) is gone: remove it from the list"
        del pgraph[src][dst]
    cycle = find_cycle(pgraph)
    assert cycle is None, "package-level import cycle (move what both need into the lower package):\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(pgraph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])
    )


# modules still over the limit, each with who splits it; an entry must go once its module is split
OVER_400: dict[str, str] = {}


def test_no_module_over_400_lines():
    """One module per concern, 100-400 lines (the project's rule): a longer one is two concerns. The package,
    its tests and its scripts alike."""
    files = [p for d in (PACKAGE, ROOT / "tests", ROOT / "scripts") for p in d.rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert set(OVER_400) <= set(long), f"split already, remove from OVER_400: {set(OVER_400) - set(long)}"
    new = {p: n for p, n in long.items() if p not in OVER_400}
    assert not new, f"split these modules (over 400 lines): {new}"


# ---- every module imports, in any order ---------------------------------------------------
_IMPORT_ALL = r"""
import importlib, importlib.util, json, sys, traceback
result = {"ok": [], "skipped": {}, "failed": {}}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        result["ok"].append(name)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing and missing != "dflash_trt" and importlib.util.find_spec(missing) is None:
            result["skipped"][name] = f"needs {e.name}, not installed here"
        else:
            result["failed"][name] = traceback.format_exc()
    except Exception:
        result["failed"][name] = traceback.format_exc()
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def import_runs() -> dict[int, dict]:
    """Per seed: a fresh interpreter importing every module in that seed's random order."""
    runs = {}
    for seed in SEEDS:
        order = sorted(module_files())
        random.Random(seed).shuffle(order)
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT_ALL, json.dumps(order)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[seed] = {"order": order, **json.loads(proc.stdout.strip().splitlines()[-1])}
    return runs


@pytest.mark.parametrize("seed", SEEDS)
def test_every_module_imports_in_a_random_order(import_runs, seed):
    run = import_runs[seed]
    assert not run["failed"], f"import order (seed {seed}): {run['order']}\n\n" + "\n".join(
        f"{m}:\n{tb}" for m, tb in run["failed"].items()
    )
    assert len(run["ok"]) + len(run["skipped"]) == len(run["order"])


def test_modules_left_out_for_an_absent_optional_dependency(import_runs):
    skipped = {m: why for run in import_runs.values() for m, why in run["skipped"].items()}
    assert all(m.startswith(("dflash_trt.serving.triton_", "dflash_trt.kernels.")) for m in skipped), skipped
    if skipped:
        pytest.skip("not importable here: " + "; ".join(f"{m} ({why})" for m, why in sorted(skipped.items())))
