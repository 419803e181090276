"""Module-level mutable state in the package (issue 47): the module globals that code changes at run time, read
from the code with ``ast``. A global a function rebinds (``global x``) and a container bound at module level that
code inside a function changes (from its own module or another) are state; a table written once and only read is
not. What remains is listed in ``ALLOWED`` with why it must be process-wide; anything new fails the test.

A class's attribute shared by its instances (a container in the class body that its methods change through
``self``, ``cls`` or the class) counts as its module's. Not read: ``functools.cache`` memos (of facts of the process:
its torch, its C library), a module ``__getattr__`` keeping a name it forwarded (_legacy_paths.forward_moved_names,
as the import system does), other libraries' objects the package patches (those keep their own records: the
collective count's ``_originals``), and a global changed through a local alias of it."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

PACKAGE = REPO / "optimum_gaudi"

# "module.name" (module below optimum_gaudi; a class's shared attribute as Class.name) -> why it is process-wide
ALLOWED = {
    "precision.autocast._warned_names": "warn once per process, as the warnings module does",
    "precision.autocast._Registration._active": "the kernels installed in torch's dispatcher (the process's), per key",
    "precision.op_lists._warned": "warn once per process, as the warnings module does",
    "devices.hpu._warned": "warn once per process, as the warnings module does",
    "devices.hpu._unavailable_reason": "why the bridge could not load; it is then hidden from sys.modules, for all",
    "devices.host_memory._depth": "the loops nested around glibc's malloc settings, which are the process's",
    "features.kernels._active_rotary": "the fused rotary kernel of the layer running on this thread: a dynamic scope",
    "features.linear_cross_entropy._MIXED_ADDMM": "a device type's capability, probed once; a dict dynamo can read",
    "features.linear_cross_entropy._AUTOCAST": "a device type's capability, asked once; a dict dynamo can read",
    "distributed.fsdp._fsdp_exported_by_a_trainer": "whether os.environ's ACCELERATE_USE_FSDP is an earlier trainer's",
    "supervision.collective_count._active": "the count torch's collectives, patched process-wide, add to",
    "supervision.collective_count._users": "the start()s sharing that count (nested trainers); the last one ends it",
    "supervision.collective_count._originals": "the originals of functions patched process-wide, restored at the end",
    "supervision.collective_count._depth": "whether this thread is inside a counted collective: count the outermost",
    "supervision.agreement._serial": "one store key per agreement of the process, in the same order on every rank",
    "supervision.watch._serial": "one set of store keys per train() of the process, in the same order on every rank",
}

# Methods that change the object they are called on (set, list, dict, deque, ContextVar)
MUTATORS = {
    "add",
    "append",
    "appendleft",
    "clear",
    "discard",
    "extend",
    "extendleft",
    "insert",
    "pop",
    "popitem",
    "popleft",
    "remove",
    "set",
    "setdefault",
    "update",
}
CONTAINERS = (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)  # optimum_gaudi's: __init__


def top_level_bindings(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Every name the module binds at its top level (also inside a top-level if or try), and those bound to a
    container: a literal, or what a call returns (``set()``, ``defaultdict(list)``, ``threading.local()``)."""
    names, containers = set(), set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):
            statements += node.body + node.orelse + getattr(node, "finalbody", []) + getattr(node, "handlers", [])
        elif isinstance(node, ast.ExceptHandler):
            statements += node.body
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = {t.id for t in targets if isinstance(t, ast.Name)}
            names |= bound
            if isinstance(node.value, (*CONTAINERS, ast.Call)):
                containers |= bound
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            shared = {f"{node.name}.{attribute}" for attribute in class_containers(node)}
            names |= shared
            containers |= shared
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names, containers


def class_containers(node: ast.ClassDef) -> set[str]:
    """The class's attributes bound to a container in its body, shared by its instances: not a dataclass's fields
    (each instance's own, ClassVars excepted), nor a default an instance replaces (``self.x = ...``)."""
    dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    found = set()
    for statement in node.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, (*CONTAINERS, ast.Call)):
            found |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.value, (*CONTAINERS, ast.Call)):
            if isinstance(statement.target, ast.Name) and (not dataclass or "ClassVar" in ast.unparse(statement)):
                found.add(statement.target.id)
    replaced = {
        t.attr
        for sub in ast.walk(node)
        if isinstance(sub, (ast.Assign, ast.AnnAssign))
        for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    return found - replaced


def imported_names(tree: ast.Module, module: str, modules: set[str]) -> dict[str, tuple[str, str | None]]:
    """What the module's imports (anywhere in it) bind to the package's modules: a local name -> (module, None)
    for a module, (module, name) for a name imported from one."""
    package = module if module in modules and any(m.startswith(module + ".") for m in modules) else ""
    package = package or module.rpartition(".")[0]
    found: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: max(0, len(package.split(".")) - node.level + 1)] if package else []
                source = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "optimum_gaudi":
                source = node.module.partition(".")[2]
            else:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}" if source else alias.name
                target = (submodule, None) if submodule in modules else (source, alias.name)
                found[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.startswith("optimum_gaudi."):
                    found[alias.asname] = (alias.name.partition(".")[2], None)
    return found


class _Finder(ast.NodeVisitor):
    """Visits one module's functions, noting which package globals each changes."""

    def __init__(self, module: str, own: set[str], imported: dict[str, tuple[str, str | None]]) -> None:
        self.module, self.own, self.imported = module, own, imported
        self.scopes: list[set[str]] = []  # the local names of each enclosing function
        self.classes: list[str] = []  # the enclosing classes
        self.rebound: set[str] = set()  # "module.name" of globals rebound with a `global` statement
        self.mutated: set[tuple[str, str]] = set()  # (module, name) of objects changed in place

    def visit_function(self, node: ast.AST) -> None:
        declared = {n for s in ast.walk(node) if isinstance(s, (ast.Global, ast.Nonlocal)) for n in s.names}
        local = set()
        arguments = node.args
        for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
            local.add(arg.arg)
        local |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
        body = node.body if isinstance(node.body, list) else [node.body]
        for statement in body:
            for sub in _own_scope(statement):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    local.add(sub.id)
                elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    local.add(sub.name)
                elif isinstance(sub, ast.ExceptHandler) and sub.name:
                    local.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    local |= {(a.asname or a.name).split(".")[0] for a in sub.names}
        self.scopes.append(local - declared)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Global(self, node: ast.Global) -> None:
        self.rebound |= {f"{self.module}.{name}" for name in node.names}

    def resolve(self, node: ast.AST) -> tuple[str, str] | None:
        """The package global an expression is, or is inside: ``x`` (this module's or imported), ``module.x``,
        ``x[key]``, ``x.attribute``."""
        while not (found := self.class_attribute(node)):
            if not isinstance(node, (ast.Subscript, ast.Attribute)) or self.names_a_module(node):
                break
            node = node.value
        if found:
            return found
        if isinstance(node, ast.Name):
            if any(node.id in scope for scope in self.scopes):
                return None
            if node.id in self.imported and self.imported[node.id][1] is not None:
                return self.imported[node.id]
            return (self.module, node.id) if node.id in self.own else None
        if isinstance(node, ast.Attribute):
            return (self.imported[node.value.id][0], node.attr)
        return None

    def class_attribute(self, node: ast.AST) -> tuple[str, str] | None:
        """A class's shared attribute: ``Class.x``, or ``self.x``/``cls.x`` in one of the class's methods."""
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            return None
        owner = node.value.id
        if owner in ("self", "cls") and self.classes:
            owner = self.classes[0]  # a top-level class's: a nested class's attributes are not listed
        elif any(owner in scope for scope in self.scopes):
            return None
        name = f"{owner}.{node.attr}"
        return (self.module, name) if name in self.own else None

    def names_a_module(self, node: ast.AST) -> bool:
        """Whether ``node`` is ``module.x``, ``module`` a package module imported here."""
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            return False
        name = node.value.id
        return not any(name in scope for scope in self.scopes) and self.imported.get(name, ("", ""))[1] is None

    def changed(self, target: ast.AST) -> None:
        if self.scopes and self.names_a_module(target):  # another module's global rebound: module.x = ...
            self.rebound.add(".".join(self.resolve(target)))
        elif self.scopes and isinstance(target, (ast.Subscript, ast.Attribute)):
            found = self.resolve(target.value)
            if found:
                self.mutated.add(found)
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.changed(element)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self.changed(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.changed(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.changed(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self.changed(target)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if self.scopes:
            function = node.func
            if isinstance(function, ast.Attribute) and function.attr in MUTATORS:
                found = self.resolve(function.value)
                if found:
                    self.mutated.add(found)
            elif isinstance(function, ast.Name) and function.id == "next" and node.args:  # an itertools.count()
                found = self.resolve(node.args[0])
                if found:
                    self.mutated.add(found)
        self.generic_visit(node)


def _own_scope(node: ast.AST):
    """``node`` and what it contains, not looking into nested functions, classes or comprehensions."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (*FUNCTIONS, ast.ClassDef)):
            yield child  # its name is bound here; its body is its own scope
        elif not isinstance(child, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            yield from _own_scope(child)


def module_state(sources: dict[str, str]) -> set[str]:
    """The globals of these modules (name -> source) that code changes at run time, as "module.name"."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    bindings = {module: top_level_bindings(tree) for module, tree in trees.items()}
    rebound, mutated = set(), set()
    for module, tree in trees.items():
        finder = _Finder(module, bindings[module][0], imported_names(tree, module, set(trees)))
        finder.visit(tree)
        rebound |= finder.rebound
        mutated |= finder.mutated
    containers = {(module, name) for module, (_, bound) in bindings.items() for name in bound}
    return rebound | {f"{module}.{name}" for module, name in mutated & containers}


def package_sources() -> dict[str, str]:
    return {module_name(p): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_packages_module_level_state_is_the_allowed_list():
    found = module_state(package_sources())
    assert sorted(found - set(ALLOWED)) == [], "new state: remove it, or list it in ALLOWED with why it is process-wide"
    assert set(ALLOWED) - found == set(), "no longer state: take it off ALLOWED"
    assert [name for name, reason in ALLOWED.items() if not reason.strip() or "\n" in reason] == []


def test_the_finder_catches_each_kind_and_leaves_tables_and_locals():
    owner = """
import collections, contextvars, dataclasses, itertools, threading, weakref
from typing import ClassVar
TABLE = {"a": 1}                     # only read: a table
NAMES = ["x", "y"]
_seen = set()
_log = []
_cache = dict()
_by_key = collections.defaultdict(list)
_refs = weakref.WeakKeyDictionary()
_queue = collections.deque()
_local = threading.local()
_var = contextvars.ContextVar("v")
_serial = itertools.count()
_deleted = {"k": 1}
_counts = {}
_from_elsewhere = set()
_imported_then_changed = []
_depth = 0
_rebound_elsewhere = 1
_built = {}
for key in TABLE:
    _built[key] = 2                  # at import: building a table
if True:
    _in_an_if = {}

def read():
    return TABLE["a"], NAMES[0], _built

def change(key):
    global _depth
    _depth += 1
    _seen.add(key)
    _log.append(key)
    _cache[key] = 1
    _by_key[key].append(1)
    _refs.setdefault(key, 1)
    _queue.popleft()
    _local.value = key
    _var.set(key)
    next(_serial)
    del _deleted["k"]
    _counts[key] += 1
    _in_an_if.update(a=1)

class Registry:
    _lock = threading.Lock()
    _installed: dict = {}           # shared by the instances
    _by_name = []
    _default = []                   # a default each instance replaces
    TABLE = {"a": 1}

    def __init__(self):
        self._default = []
        self._installed[1] = self
        self._default.append(1)
        self.TABLE.get("a")

    @classmethod
    def register(cls):
        Registry._by_name.append(cls)

@dataclasses.dataclass
class Fields:
    each: list = dataclasses.field(default_factory=list)
    shared: ClassVar[set] = set()

    def add(self):
        self.each.append(1)
        self.shared.add(1)

def shadows(NAMES, TABLE=None):
    _log = []
    _log.append(1)                   # a local of the same name
    NAMES.append(1)
    TABLE[0] = 1
    return [_cache for _cache in ({},)], (lambda _seen: _seen.add(1))
"""
    other = """
from . import owner
from .owner import _imported_then_changed
import optimum_gaudi.pkg.owner as aliased

def elsewhere():
    owner._from_elsewhere.discard(1)
    aliased._rebound_elsewhere = 2
    _imported_then_changed.extend([1])
    aliased.TABLE.get("a")           # a read
"""
    found = module_state({"pkg.owner": owner, "pkg.other": other, "pkg": ""})
    changed = "_seen _log _cache _by_key _refs _queue _local _var _serial _deleted _counts _in_an_if _depth"
    changed += " _from_elsewhere _imported_then_changed _rebound_elsewhere"
    changed += " Registry._installed Registry._by_name Fields.shared"
    assert found == {f"pkg.owner.{name}" for name in changed.split()}
