"""The package's import graph points one way (ARCHITECTURE.md).

Every ``import`` of a ``vllm_lowrank`` module anywhere in a module (top level or
inside a function: a lazy import is still a dependency) is an edge. The test
fails on any import cycle and on any edge from a lower layer to a higher one
(:data:`LAYERS`, lowest first); modules of one layer may import each other.
Pure static analysis (``ast``): nothing is imported, no vLLM needed.
"""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

ROOT = REPO

LAYERS = (
    ("errors",),
    ("inputs", "presets", "config", "compat"),
    ("metrics",),
    ("format", "factorization"),
    ("kernels",),
    ("attention",),
    ("calibration",),
    ("models",),
    ("passkey", "cloze", "evaluation", "embedded", "patches", "serve_entry", "local_server",
     "estimate"),
    ("cli", "plugin"),
)
"""Top-level units of ``vllm_lowrank`` (modules or sub-packages), lowest first."""


def _module_files() -> dict[str, pathlib.Path]:
    files = {}
    for path in (ROOT / "vllm_lowrank").rglob("*.py"):
        rel = path.relative_to(ROOT / "vllm_lowrank").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        files[".".join(["vllm_lowrank", *parts])] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of this package it imports}``."""
    files = _module_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in files and t != name)
        graph[name] = deps
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_every_unit_has_a_layer():
    rank = {u for layer in LAYERS for u in layer}
    units = {_unit(m) for m in import_graph()} - {""}
    assert units <= rank, f"units without a layer in LAYERS: {sorted(units - rank)}"


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down():
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    rank[""] = 0  # the package root holds only __version__
    upward = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps
                    if rank[_unit(b)] > rank[_unit(a)])
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_checks_see_cycles_and_upward_imports():
    """The graph walker finds a planted cycle; the layer order is not vacuous."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "vllm_lowrank.attention.backend" in graph["vllm_lowrank.attention.layer"]
    assert "vllm_lowrank.kernels.triton.tiles" in graph["vllm_lowrank.kernels.triton.decode"]
    assert not any("vllm_lowrank.plugin" in deps for deps in graph.values())
