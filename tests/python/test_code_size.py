"""Every module of ``python/megatrain`` stays readable: no module over 400 lines, no function over 80.

Counted statically with ``ast``: a function's lines run from its ``def`` to its last statement, its
docstring left out (a public function's docstring is its reference documentation, not logic to read
through); a module's are its physical lines. A unit that grows past a limit fails here
with its path and size: split it by what its parts do (docs/architecture.md, "Where to change what").
"""

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "python" / "megatrain"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sizes(package_dir=PACKAGE_DIR):
    """``(name, lines, limit)`` for every module and function under ``package_dir``."""
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).as_posix()
        source = path.read_text()
        yield rel, source.count("\n"), MAX_MODULE_LINES
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                    lines -= first.end_lineno - first.lineno + 1  # the docstring
                yield f"{rel}:{node.name}", lines, MAX_FUNCTION_LINES


def test_no_module_or_function_over_its_limit():
    over = [f"{name}: {lines} lines (limit {limit})" for name, lines, limit in _sizes()
            if lines > limit]
    assert not over, "split these by what their parts do:\n" + "\n".join(over)


def test_the_counter_sees_an_oversized_function_and_module(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = '    """A docstring\n    of three lines\n    is not counted."""\n'
    (tmp_path / "big.py").write_text(f"def big():\n{doc}{body}\n" + "\n" * MAX_MODULE_LINES)
    found = {name: lines for name, lines, _ in _sizes(tmp_path)}
    assert found["big.py:big"] == MAX_FUNCTION_LINES + 1
    assert found["big.py"] > MAX_MODULE_LINES
