"""Issue 47's size targets, read with ast: no function in optimum_gaudi/ longer than 60 lines (a function a reader
can hold in one screen), the trainer mixin a switchboard of at most 25 methods in a trainer.py of at most 600
lines. A function's length is its ast node's lines, decorators not counted; a nested function is checked on its
own too (and counts within the function around it)."""

from __future__ import annotations

import ast
import textwrap

from support import REPO

PACKAGE = REPO / "optimum_gaudi"
LIMIT = 60
MIXIN_METHODS = 25
TRAINER_LINES = 600


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


def test_the_trainer_mixin_is_a_switchboard_of_at_most_25_methods_in_at_most_600_lines():
    """Each concern lives in an object of its own (docs/architecture.md's "Where X happens"); the mixin's hooks
    hand their parent's implementation on. A method more is a concern moving back into the hub."""
    path = PACKAGE / "trainers" / "trainer.py"
    source = path.read_text(encoding="utf-8")
    (mixin,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "GaudiTrainerMixin"]
    methods = [n.name for n in mixin.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= MIXIN_METHODS, methods
    assert len(source.splitlines()) <= TRAINER_LINES
