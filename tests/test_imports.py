"""normkit's modules import each other without a cycle, counting the imports inside functions too
(issue 22: the cycles blocks <-> patch, _host <-> backends/triton and inside bench/ went, and none
may come back): each module's dependencies can be read, and changed, one direction at a time."""
import ast
from pathlib import Path

import normkit

ROOT = Path(normkit.__file__).parent


def _modules() -> dict:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("normkit",) + path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict) -> set:
    """The normkit modules `name` imports anywhere in its file (a package's submodule where one is named)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for a in node.names:
                target = f"{base}.{a.name}"
                found.add(target if target in mods else base)
    return {m for m in found if m in mods and m != name}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_normkit_has_no_import_cycle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert len(mods) > 40 and graph["normkit.functional"] >= {"normkit._library", "normkit._host"}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
