"""No function in optimum_gaudi/ is longer than 60 lines: issue 47's target, a function a reader can hold in one
screen. A function's length is its ast node's lines, decorators not counted; a nested function is checked on its
own too (and counts within the function around it)."""

from __future__ import annotations

import ast
import textwrap

from support import REPO

PACKAGE = REPO / "optimum_gaudi"
LIMIT = 60


def long_functions(source: str, path: str, limit: int = LIMIT) -> list[str]:
    """``path:line name (N lines)`` for each function in ``source`` longer than ``limit`` lines, in line order."""
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for node in sorted(functions, key=lambda n: n.lineno):
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            found.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_60_lines():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += long_functions(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())
    assert not found, "functions over 60 lines:\n" + "\n".join(found)


def test_the_check_catches_a_long_function_and_a_long_nested_one_but_not_a_decorator():
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    source = "\n".join(
        [
            "@decorator",  # line 1: not counted, so `fits` is 60 lines
            function("fits", LIMIT),  # lines 2-61
            function("too_long", LIMIT + 1),  # lines 63-123
            "class C:",  # line 125
            "    def method(self):",  # line 126
            textwrap.indent(function("inner", LIMIT + 1), " " * 8),  # lines 127-187
        ]
    )
    assert long_functions(source, "m.py") == [
        "m.py:63 too_long (61 lines)",
        "m.py:126 method (62 lines)",
        "m.py:127 inner (61 lines)",
    ]
