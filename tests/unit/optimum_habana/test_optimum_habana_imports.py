"""docs/optimum-habana.md's import table ports optimum-habana's example scripts (issue 32, points 3 and 4).

optimum-habana's scripts are not shipped here: tests/data/optimum_habana_imports.txt stands in for them, one block
per script holding each of its optimum-habana imports (and the transformers imports the table has a row for)
followed by what the script does with the names. Each block is ported by applying the table's rows, as a user would,
and run. The ``examples`` extra of setup.py must install every module outside the standard library that those
scripts and ours import.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib.metadata import packages_distributions

import pytest
from support import REPO

DOC = (REPO / "docs" / "optimum-habana.md").read_text(encoding="utf-8")
STAND_IN = (REPO / "tests" / "data" / "optimum_habana_imports.txt").read_text(encoding="utf-8")

# Rows whose target another branch adds; their blocks are skipped, with the reason, until it is merged.
PENDING = {
    "apply_zero3_leaf_promotion": "optimum_gaudi.distributed.apply_zero3_leaf_promotion is added by issue 32's "
    "TRL work on another branch, not merged here",
}
# Modules the examples import that no pip extra of ours should bring.
NOT_FROM_PIP = {
    "habana_frameworks": "the Intel Gaudi software, installed with the machine's driver",
    "deepspeed": "its own extra (`deepspeed`): a Gaudi needs Habana's fork instead",
}


def import_rows() -> list[tuple[str, list[str]]]:
    """(optimum-habana import, optimum-gaudi imports) of each row of the doc's Imports table that names one."""
    section = DOC.split("\n## Imports\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.strip().strip("|").split(" | ")
        statements = [re.findall(r"`((?:from|import) [^`]+)`", cell) for cell in cells]
        if len(cells) == 2 and statements[0]:
            rows.append((statements[0][0], statements[1]))
    return rows


def parse_from(statement: str) -> tuple[str, list[str]]:
    module, names = re.fullmatch(r"from (\S+) import (.+)", statement).groups()
    return module, [name.strip() for name in names.split(",")]


def name_map() -> dict[tuple[str, str], tuple[str, str] | None]:
    """(module, name) -> (module, name) to import instead, or None where the row drops the name. A row maps its
    names by name, by position where both sides list as many, or keeps them all where the right side says ``...``."""
    mapping: dict[tuple[str, str], tuple[str, str] | None] = {}
    for left, right in import_rows():
        module, names = parse_from(left)
        targets = [parse_from(statement) for statement in right]
        by_name = {name: target for target, target_names in targets for name in target_names}
        listed = [(target, name) for target, target_names in targets for name in target_names if name != "..."]
        for position, name in enumerate(names):
            if "..." in by_name:
                new = (by_name["..."], name)
            elif name in by_name:
                new = (by_name[name], name)
            elif len(listed) == len(names):
                new = listed[position]
            else:
                new = None
            key = (module, "*" if name == "..." else name)
            assert mapping.get(key, new) == new, f"two rows of the import table disagree on {key}"
            mapping[key] = new
    return mapping


MAP = name_map()
TABLE_MODULES = {module for module, _ in MAP}


def blocks() -> dict[str, str]:
    parts = re.split(r"^# ---- (.+)$", STAND_IN, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def port(source: str) -> tuple[str, set[tuple[str, str]]]:
    """``source`` with the table applied: each import the table has rows for rewritten, the lines using a dropped
    name deleted, renamed names replaced. Also the (module, name) keys used. A name without a row fails."""
    lines = source.splitlines()
    replaced: dict[int, list[str]] = {}
    dropped, renamed, used = set(), {}, set()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ImportFrom) or node.module not in TABLE_MODULES | {"optimum.habana"}:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optimum.habana"):
                pytest.fail(f"docs/optimum-habana.md has no import row for `from {node.module} import ...`")
            continue
        new_imports: dict[str, list[str]] = {}
        for alias in node.names:
            key = (node.module, alias.name) if (node.module, alias.name) in MAP else (node.module, "*")
            if key not in MAP:
                pytest.fail(f"docs/optimum-habana.md has no import row for `from {node.module} import {alias.name}`")
            used.add(key)
            target = MAP[key]
            if target is None:
                dropped.add(alias.name)
                continue
            new_imports.setdefault(target[0], []).append(target[1])
            if target[1] != alias.name:
                renamed[alias.name] = target[1]
        replaced[node.lineno - 1] = [
            f"from {module} import {', '.join(names)}" for module, names in new_imports.items()
        ]
        for index in range(node.lineno, node.end_lineno):
            replaced[index] = []
    ported = []
    for index, line in enumerate(lines):
        if index in replaced:
            ported += replaced[index]
        elif not any(re.search(rf"\b{name}\b", line) for name in dropped):
            for old, new in renamed.items():
                line = re.sub(rf"\b{old}\b", new, line)
            ported.append(line)
    return "\n".join(ported) + "\n", used


@pytest.mark.parametrize("script", list(blocks()))
def test_the_import_table_ports_each_script(script):
    ported, _ = port(blocks()[script])
    assert "optimum.habana" not in ported
    try:
        exec(compile(ported, f"<{script} ported>", "exec"), {"__name__": "ported"})
    except ImportError as e:
        reason = next((why for name, why in PENDING.items() if name in str(e)), None)
        if reason is None:
            raise
        pytest.skip(reason)


def test_every_row_of_the_import_table_is_tried_on_the_stand_in():
    used = set().union(*(port(block)[1] for block in blocks().values()))
    assert {key for key in MAP if key[1] != "*"} - used == set()  # a row ending in `...` is tried by its first name


def test_a_script_importing_a_name_without_a_row_fails_the_port():
    with pytest.raises(pytest.fail.Exception, match="no import row for `from optimum.habana.peft import"):
        port("from optimum.habana.peft import gaudi_generate\n")


def test_telemetry_goes_with_its_import():
    ported, _ = port(blocks()["language-modeling/run_clm.py"])
    assert "send_example_telemetry" not in ported
    assert "from transformers.utils import check_min_version\n" in ported


# ---- point 4: one extra installs what the examples import ------------------------------------------------------


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """install_requires and extras_require, read from setup.py's literals (the installed metadata may be another
    checkout's)."""
    call = next(
        node
        for node in ast.walk(ast.parse((REPO / "setup.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    return ast.literal_eval(keywords["install_requires"]), ast.literal_eval(keywords["extras_require"])


def distribution(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    return packages_distributions()


def module_distribution(module: str) -> str:
    """The PyPI name that installs ``module``: the installed one's own metadata, else the module's name."""
    return installed_distributions().get(module, [module])[0].lower().replace("_", "-")


def our_example_imports() -> set[str]:
    found = set()
    for path in (REPO / "examples").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    own = {path.stem for path in (REPO / "examples").rglob("*.py")} | {"optimum_gaudi"}
    return {module for module in found if module not in sys.stdlib_module_names and module not in own}


def stand_in_imports() -> set[str]:
    return {module for line in re.findall(r"^# imports: (.+)$", STAND_IN, flags=re.M) for module in line.split()}


@pytest.mark.parametrize("source", ["our examples", "optimum-habana's scripts"])
def test_the_examples_extra_installs_every_module_the_examples_import(source):
    modules = our_example_imports() if source == "our examples" else stand_in_imports()
    assert modules, "no imports found"
    required, extras = setup_requirements()
    provided = {distribution(requirement) for requirement in [*required, *extras["examples"]]}
    missing = {
        module: module_distribution(module)
        for module in modules - set(NOT_FROM_PIP)
        if module_distribution(module) not in provided
    }
    assert missing == {}, f"setup.py's examples extra lacks {missing}"


@pytest.mark.parametrize("doc", ["docs/optimum-habana.md", "README.md"])
def test_the_docs_give_the_examples_install_line(doc):
    assert "pip install 'optimum-gaudi[examples]'" in (REPO / doc).read_text(encoding="utf-8")
