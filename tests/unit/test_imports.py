"""The floor plan, read from the source (nothing is imported): arrows run down, never back up or round.

Invariants checked:
- config/ is the ground floor: it imports none of the project's packages but itself.
- Nothing under actors/, tasks/, policies/, queues/, observe/, weights/ or config/ imports launch/
  (the launcher sits on top; bench/ and tests/ may import anything).
- No import circle among the project's modules, counting imports inside functions too (a deferred
  import hides a circle from Python, not from a reader).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "bench", "config", "launch", "observe", "policies", "queues", "tasks", "weights")
BELOW_LAUNCH = ("actors", "config", "observe", "policies", "queues", "tasks", "weights")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules `name` imports (the deepest known module each import names)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items()}


def test_config_is_the_ground_floor():
    bad = {m: sorted(d for d in deps if not d.startswith("config"))
           for m, deps in _graph().items() if m.split(".")[0] == "config"}
    assert not {m: d for m, d in bad.items() if d}, f"config imports the project: {bad}"


def test_nothing_below_the_launcher_imports_it():
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "launch")
           for m, deps in _graph().items() if m.split(".")[0] in BELOW_LAUNCH}
    assert not {m: d for m, d in bad.items() if d}, f"arrows back up to launch/: {bad}"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def _is_init(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").is_file()


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ that re-exports its own modules does not close a circle with them
    edges = {m: {d for d in deps if not (d == m.rpartition(".")[0] and _is_init(d))} for m, deps in graph.items()}
    circles = _circles(edges)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_checker_sees_a_deferred_circle_and_an_upward_arrow(tmp_path):
    """The checks can fail: an import inside a function still counts, and a circle is found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from policies import planted_b\n")
    b.write_text("def f():\n    import tasks.planted_a\n    from launch import run\n")
    known = {"tasks.planted_a", "policies.planted_b", "launch.run"}
    edges = {"tasks.planted_a": _imports("tasks.planted_a", a, known),
             "policies.planted_b": _imports("policies.planted_b", b, known)}
    assert edges == {"tasks.planted_a": {"policies.planted_b"}, "policies.planted_b": {"tasks.planted_a", "launch.run"}}
    assert _circles(edges) == [["policies.planted_b", "tasks.planted_a"]]


