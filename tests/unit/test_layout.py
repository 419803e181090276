"""The package layout's rules (docs/architecture.md), read from the code's own imports: each folder imports
only the folders below it, and no modules import each other in a circle. Lazy imports inside functions count.

What needs a fresh process (the launcher without torch, the old module paths): tests/integration/test_layout_in_fresh_processes.py."""

from __future__ import annotations

import ast
import re
import sys
import warnings
from pathlib import Path

import pytest
from support import REPO

PACKAGE = REPO / "optimum_gaudi"


# What each part of the package may import (a part is a top-level module or folder). Lowest first.
ALLOWED = {
    "errors": set(),
    "_legacy_paths": set(),
    "seam": set(),  # the one writer of what model preparation changes on a model: any layer's code may write there
    "precision": {"errors", "_legacy_paths", "seam"},
    "configuration": {"errors", "_legacy_paths", "precision"},
    "data": {"errors", "_legacy_paths"},
    "checkpoints": {"errors"},
    "planning": {"errors"},  # arithmetic only: no torch, no trainer code
    "devices": {"errors", "precision", "configuration"},
    "launch": {"errors", "precision", "configuration"},  # and no torch: test_the_launcher_loads_without_torch
    "features": {"errors", "seam", "precision", "configuration", "devices"},
    "distributed": {"errors", "seam", "precision", "configuration", "devices"},
    # run supervision: preemption, the non-finite guard, the watchdog and its collective count, stragglers
    "supervision": {"errors", "launch"},  # launch: what the launcher tells its ranks (launch/ranks.py)
    # model preparation's stages, in order: above the features and the parallelism they apply
    "preparation": {"errors", "seam", "precision", "configuration", "devices", "features", "distributed"},
    "trainers": {
        "errors",
        "precision",
        "configuration",
        "devices",
        "features",
        "distributed",
        "preparation",
        "supervision",
        "seam",
        "checkpoints",
        "launch",
        "planning",
    },
    "cli": {"errors", "precision", "configuration", "devices", "features", "launch", "planning"},
    "__init__": {"_legacy_paths", "configuration", "trainers"},
    "__main__": {"cli", "_legacy_paths"},  # `python -m optimum_gaudi` and the 0.1 `python -m optimum_gaudi.launch`
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> set[str]:
    """The optimum_gaudi modules ``path`` imports, anywhere in the file, resolved to absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "optimum_gaudi":
                continue
            if node.module is None or node.level and not node.module:  # `from . import x`: x may be a module
                found.update(f"{target}.{alias.name}" for alias in node.names)
            else:
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "optimum_gaudi")
    return {resolve_module(t) for t in found if t != "optimum_gaudi"}


def resolve_module(name: str) -> str:
    """``name`` itself when it is a module or package of ours, else the module it is a name in."""
    while name.count("."):
        relative = Path(*name.split(".")[1:])
        if (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative).is_dir():
            return name
        name = name.rpartition(".")[0]
    return name


def part_of(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "__main__":  # what `python -m` runs: an entry point above everything, whatever folder it is in
        return "__main__"
    return parts[1] if len(parts) > 1 else "__init__"


def layering_violations(imports: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(imports.items()):
        part = part_of(module)
        if part not in ALLOWED:
            problems.append(f"{module}: part {part!r} is not in the layout (add it to ALLOWED and the docs)")
            continue
        for target in sorted(targets):
            other = part_of(target)
            if other != part and other not in ALLOWED[part]:
                problems.append(f"{module} imports {target}: {part} may not import {other}")
    return problems


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in imports.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(imports):
        if node not in index:
            visit(node)
    return found


def package_import_graph() -> dict[str, set[str]]:
    graph = {module_name(p): package_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
    for module, targets in graph.items():  # a package's __init__ is not a circle with its own modules
        graph[module] = {t for t in targets if not (module.startswith(t + ".") or t == module)}
    return graph


def test_every_import_follows_the_layering_rules():
    assert layering_violations(package_import_graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(package_import_graph()) == []


def test_no_test_file_imports_another():
    """What test files share lives in tests/'s own modules (tiny.py, support.py, conftest.py): a test file is
    importable only once pytest has collected its folder, and its tests would be collected twice."""
    tests = REPO / "tests"
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.relative_to(tests)} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert found == []


def test_the_checks_catch_a_device_importing_the_trainer_and_a_circle():
    bad = {
        "optimum_gaudi.devices.cpu": {"optimum_gaudi.trainers.trainer"},
        "optimum_gaudi.trainers.trainer": {"optimum_gaudi.trainers.compat"},
        "optimum_gaudi.trainers.compat": {"optimum_gaudi.trainers.trainer"},
    }
    assert layering_violations(bad) == [
        "optimum_gaudi.devices.cpu imports optimum_gaudi.trainers.trainer: devices may not import trainers"
    ]
    assert circles(bad) == [["optimum_gaudi.trainers.compat", "optimum_gaudi.trainers.trainer"]]


def test_lazy_and_relative_imports_are_read():
    imports = package_imports(PACKAGE / "devices" / "base.py")  # imports ..precision.autocast inside a method
    assert "optimum_gaudi.precision.autocast" in imports


def test_the_architecture_doc_names_every_folder_and_top_level_module():
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = doc.split("```", 2)[1]
    named = set(re.findall(r"^\s*([\w.]+?)/?\s", tree, flags=re.M))
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.name for p in PACKAGE.glob("*.py")}
    assert parts - named == set()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("optimum_gaudi.graphs", "optimum_gaudi.features.graphs"),
        ("optimum_gaudi.distributed.launcher", "optimum_gaudi.launch.launcher"),  # 0.2's launcher paths
        ("optimum_gaudi.distributed.launch_plan", "optimum_gaudi.launch.plan"),
        ("optimum_gaudi.configuration.launch_env", "optimum_gaudi.launch.environment"),
        ("optimum_gaudi.devices.autocast", "optimum_gaudi.precision.autocast"),  # precision's homes before precision/
        ("optimum_gaudi.configuration.op_lists", "optimum_gaudi.precision.op_lists"),
    ],
)
def test_an_old_module_path_imports_the_new_module_after_one_warning(old, new):
    import importlib

    from optimum_gaudi._legacy_paths import MOVED

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert [str(w.message).split(";")[0] for w in caught] == [f"{old} moved to {new}"]
    for path in MOVED.values():
        importlib.import_module(path)  # every new home exists
