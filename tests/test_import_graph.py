"""quantkit's import graph, read from the source: no cycle between its modules, and the layers of DESIGN.md
("Which way imports go") hold — every import counts, those inside functions too.

A node is a module of quantkit/ (a package is its __init__.py). `import quantkit.a.b` and
`from quantkit.a import b` with b a submodule are edges to quantkit.a.b; `from quantkit.a import name` is an
edge to quantkit.a; relative imports are resolved. Importing a module runs its packages' __init__ files
too, but those implicit imports are no edges here (every module would otherwise sit in a cycle with the
top package, whose functions import the API they front).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "quantkit"

# Layer → the modules (a name or a package prefix) it may import besides its own package. Under everything,
# modules that import nothing of quantkit's: config.py, version.py and packing.py (the int32 word arithmetic
# that the formats and the kernels' reference share); the lowest layer imports those and nothing else.
LEAVES = ("quantkit.config", "quantkit.packing", "quantkit.version")
ALLOWED: dict[str, tuple[str, ...]] = {leaf: () for leaf in LEAVES}
ALLOWED.update({prefix: LEAVES for prefix in ("quantkit.kernels", "quantkit.formats", "quantkit.models",
                                              "quantkit.data")})
ALLOWED["quantkit.nn"] = ("quantkit.kernels",)
# engine/ and runtime/ sit below every user of them: never the server, the CLI, quantize/, eval/ or the
# top package's API.
FORBIDDEN = {prefix: ("quantkit.server", "quantkit.cli", "quantkit.demo", "quantkit.quantize", "quantkit.eval")
             for prefix in ("quantkit.engine", "quantkit.runtime")}

# Edges allowed to break the layers, each with its reason (none today); an entry that no longer exists
# fails the test, so the list only shrinks.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def build_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}} over quantkit/."""
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:   # `import quantkit.a.b` names quantkit.a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a path back to its start) from each strongly connected component of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:       # Tarjan's algorithm; the graph has ~120 nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for component in components:
        inside, start = set(component), component[0]
        paths, seen = {start: [start]}, {start}
        frontier = [start]
        while frontier:                      # breadth first: the shortest way back to `start`
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start and len(paths[v]) > 1:
                        cycles.append(paths[v] + [start])
                        nxt = []
                        break
                    if w in inside and w not in seen:
                        seen.add(w)
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                else:
                    continue
                break
            frontier = nxt
    return cycles


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    bad = []
    for src, edges in graph.items():
        for dst in edges:
            for prefix, allowed in ALLOWED.items():
                if _under(src, prefix) and not _under(dst, prefix) and not any(_under(dst, a) for a in allowed):
                    bad.append((src, dst))
            for prefix, forbidden in FORBIDDEN.items():
                if _under(src, prefix) and (dst == "quantkit" or any(_under(dst, f) for f in forbidden)):
                    bad.append((src, dst))
    return sorted(set(bad))


def test_the_graph_sees_every_kind_of_import():
    graph = build_graph()
    assert "quantkit.kernels.launch" in graph["quantkit.kernels.triton_paged"]            # from x import name
    assert "quantkit.engine.model" in graph["quantkit.engine.llm_engine"]                 # inside a function
    assert "quantkit.quantize.api" in graph["quantkit"]                                   # x a submodule
    assert all(len(edges) < len(graph) for edges in graph.values()) and len(graph) > 50
    cyclic = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
    assert find_cycles(cyclic) == [["a", "b", "c", "a"]] and find_cycles({"a": {}, "b": {"a": 1}}) == []
    upward = {"quantkit.kernels.a": {"quantkit.nn.b": 1, "quantkit.config": 1, "quantkit.kernels.c": 1},
              "quantkit.engine.x": {"quantkit.server.y": 1, "quantkit.kernels.a": 1, "quantkit": 1}}
    assert layer_violations(upward) == [("quantkit.engine.x", "quantkit"), ("quantkit.engine.x", "quantkit.server.y"),
                                        ("quantkit.kernels.a", "quantkit.nn.b")]


def test_no_import_cycle_inside_quantkit():
    graph = build_graph()
    cycles = find_cycles(graph)
    lines = [" → ".join(f"{m} (line {graph[m][n]})" if n else m for m, n in zip(c, c[1:] + [None]))
             for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_imports_go_down_the_layers():
    graph = build_graph()
    bad = layer_violations(graph)
    new = [f"{src} → {dst} (line {graph[src][dst]})" for src, dst in bad if (src, dst) not in KNOWN_EXCEPTIONS]
    assert not new, "imports against the layers of DESIGN.md:\n" + "\n".join(new)
    assert not KNOWN_EXCEPTIONS - set(bad), f"fixed, drop from KNOWN_EXCEPTIONS: {KNOWN_EXCEPTIONS - set(bad)}"


def private_imports() -> list[str]:
    """`from quantkit.x import _name` in a module other than x: a private name used as if it were API."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quantkit") and node.module != name:
                found += [f"{name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_modules():
    found = private_imports()
    assert not found, "make the name public where it is shared, or move it:\n" + "\n".join(found)
