"""The import graph of ``python/megatrain`` has no cycle.

The graph is built statically with ``ast``: every ``import`` / ``from ... import`` of a project
module, at module level AND inside functions (a lazy import that only hides a cycle is still a
cycle), relative imports resolved, plus ``importlib.import_module("megatrain....")`` with a
literal name. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg`` (whose ``__init__`` runs). Compiled extensions (``_C``) are leaves.
"""

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "python" / "megatrain"


def _modules(package_dir: Path) -> dict:
    """Dotted module name -> (source path or None for a compiled extension, is_package)."""
    root = package_dir.parent
    mods = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    for path in package_dir.rglob("*.so"):
        parts = list(path.relative_to(root).parts)
        parts[-1] = parts[-1].split(".", 1)[0]
        mods.setdefault(".".join(parts), (None, False))
    return mods


def _imported_names(tree: ast.AST, module: str, is_pkg: bool, top: str):
    """(line, candidates) for every import in ``tree``, relative ones made absolute.

    ``candidates`` holds the dotted names the import may mean, most specific first:
    ``from pkg import name`` is ``pkg.name`` when that is a module, else ``pkg``.
    """
    base = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, (alias.name,)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                target = anchor + ("." + node.module if node.module else "")
            else:
                target = node.module or ""
            for alias in node.names:
                yield node.lineno, (target + "." + alias.name, target)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and node.args[0].value.startswith(top):
                yield node.lineno, (node.args[0].value,)


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict:
    """Module -> {imported project module: first line number} for every module of the package."""
    mods = _modules(package_dir)
    top = package_dir.name
    graph = {}
    for module, (path, is_pkg) in mods.items():
        edges = graph.setdefault(module, {})
        if path is None:
            continue
        for line, candidates in _imported_names(ast.parse(path.read_text(), str(path)), module, is_pkg, top):
            name = next((c for c in candidates if c in mods), None)
            if name is not None and name != module:
                edges.setdefault(name, line)
    return graph


def find_cycle(graph: dict):
    """One cycle as a list of modules (first == last), or ``None``; deterministic (sorted walk)."""
    state = {}  # module -> 1 on the stack, 2 done
    stack = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _describe(graph: dict, cycle: list) -> str:
    return "\n".join(f"  {a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:]))


def test_package_has_no_import_cycle():
    graph = import_graph()
    assert "megatrain.runtime.model.wrap" in graph and graph["megatrain.runtime"], "the graph missed modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among megatrain modules:\n" + _describe(graph, cycle)


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "megatrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from megatrain.sub import a\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('megatrain.sub.a')\n")
    graph = import_graph(pkg)
    assert graph["megatrain.c"] == {"megatrain.sub.a": 2}
    assert find_cycle(graph) == ["megatrain.sub.a", "megatrain.sub.b", "megatrain.sub.a"]
