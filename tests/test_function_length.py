"""No function in gpunb/ is longer than 60 lines, from its `def` to its last line.

A longer one holds more than one idea: split it by meaning (as runtime/loop.py's
_prepare and _train are), not at an arbitrary line.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"
LIMIT = 60


def long_functions(tree: ast.AST, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(name, lines) of each function or method in `tree` longer than `limit` lines."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_over_60_lines():
    found = [f"  {path.relative_to(PACKAGE.parent)}: {name} ({lines} lines)"
             for path in sorted(PACKAGE.rglob("*.py"))
             for name, lines in long_functions(ast.parse(path.read_text(), filename=str(path)))]
    assert not found, f"functions over {LIMIT} lines:\n" + "\n".join(found)


def test_a_long_method_is_seen():
    body = "\n".join(f"        x{i} = {i}" for i in range(LIMIT))
    tree = ast.parse(f"class A:\n    def m(self):\n{body}\n")
    assert long_functions(tree) == [("m", LIMIT + 1)]
    assert long_functions(tree, limit=LIMIT + 1) == []
