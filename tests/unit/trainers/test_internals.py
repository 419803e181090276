"""Other libraries' internals: the list in optimum_gaudi/trainers/internals.py matches the code, every entry holds in
the installed releases, and one that does not fails a trainer's construction in one line (issue 39, item 5).

``make test-compat`` runs this file on the other transformers releases (and the newest accelerate and peft)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
from support import REPO

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.trainers import internals
from optimum_gaudi.trainers.internals import INTERNALS, STDLIB, Internal, InternalsError, check_internals

PACKAGE = REPO / "optimum_gaudi"
# The Gaudi trainers' own files: a private name they set on ``self`` that transformers' Trainer also sets is
# Trainer state written, not ours.
MIXIN_FILES = {"trainers/trainer.py", "trainers/seq2seq.py", "trainers/trl.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _census() -> tuple[set[tuple[str, str]], set[str], set[tuple[str, str]]]:
    """(private names used, file) pairs; the package's own private attribute names; (name, file) pairs set on
    ``self`` in the trainers' files."""
    used, own, stored_on_self = set(), {p.stem for p in PACKAGE.rglob("_*.py")}, set()
    for path in PACKAGE.rglob("*.py"):
        file = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                if isinstance(node, ast.ClassDef):  # class attributes
                    targets = [t for s in node.body if isinstance(s, ast.Assign) for t in s.targets]
                    targets += [s.target for s in node.body if isinstance(s, ast.AnnAssign)]
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                receiver = node.value
                if isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) == "super":
                    used.add((node.attr, file))  # the parent's method: always another library's
                elif isinstance(node.ctx, ast.Store) and getattr(receiver, "id", None) in ("self", "cls"):
                    own.add(node.attr)
                    stored_on_self.add((node.attr, file))
                else:
                    used.add((node.attr, file))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value)):
                    used.add((node.args[1].value, file))
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                for part in [p for m in modules for p in m.split(".")] + names:
                    if _private(part):
                        used.add((part, file))
    return used, own, stored_on_self


def _trainer_source() -> str:
    import transformers.trainer

    return Path(transformers.trainer.__file__).read_text(encoding="utf-8")


def test_every_private_name_of_another_library_the_package_uses_is_listed_with_its_file():
    used, own, stored_on_self = _census()
    trainer_source = _trainer_source()
    foreign = {(name, file) for name, file in used if name not in own and not name.startswith("_gaudi")}
    foreign |= {(n, f) for n, f in used if (n, f) in {(i.name, u) for i in INTERNALS for u in i.used_by}}
    # Trainer state the Gaudi trainers write (a resumed run's loss totals)
    foreign |= {(n, f) for n, f in stored_on_self if f in MIXIN_FILES and re.search(rf"self\.{n}\b", trainer_source)}
    listed = {(entry.name, file) for entry in INTERNALS for file in entry.used_by}
    missing = sorted((n, f) for n, f in foreign if (n, f) not in listed and n not in STDLIB)
    assert not missing, f"private names of other libraries used but not in trainers/internals.py: {missing}"
    assert ("_shared_state", "distributed/fsdp.py") in foreign  # the census sees what the issue named
    assert ("_total_loss_scalar", "trainers/checkpointing.py") in foreign


def _parent_trainer_sources() -> dict[str, str]:
    """The source of every Trainer the Gaudi trainers are built on: transformers' Trainer and Seq2SeqTrainer, and
    TRL's SFT, DPO and GRPO trainers where TRL is installed (the ``trl`` extra)."""
    modules = ["transformers.trainer", "transformers.trainer_seq2seq"]
    modules += [f"trl.trainer.{name}_trainer" for name in ("sft", "dpo", "grpo")]
    sources = {}
    for name in modules:
        spec = importlib.util.find_spec(name) if importlib.util.find_spec(name.split(".")[0]) else None
        if spec is not None and spec.origin:
            sources[name] = Path(spec.origin).read_text(encoding="utf-8")
    return sources


def test_no_private_attribute_the_gaudi_trainers_set_is_one_a_parent_trainer_uses_unless_listed():
    """A name the mixin stores on ``self`` that a parent Trainer uses too is the parent's state overwritten: TRL's
    GRPOTrainer counts its generation steps in ``self._step``, which the mixin once used for its training step
    (every GRPO run failed in its first step). Rename it, or list it in internals.py where writing it is meant."""
    _, _, stored_on_self = _census()
    listed = {(entry.name, file) for entry in INTERNALS for file in entry.used_by}
    sources = _parent_trainer_sources()
    assert "transformers.trainer" in sources
    clashes = sorted(
        (name, file, module)
        for name, file in stored_on_self
        if file in MIXIN_FILES and (name, file) not in listed
        for module, source in sources.items()
        if re.search(rf"self\.{name}\b", source)
    )
    assert not clashes, f"(attribute, our file, the parent's module) the mixin and a parent Trainer share: {clashes}"


# Python's own objects whose function the package replaces: not another library's
STDLIB_PATCHES = {
    "excepthook": "sys.excepthook: a user error's one line (errors.py)",
    "error": "the CLI's own argparse parser's error (errors.py)",
}


def _patches() -> set[tuple[str, str]]:
    """(public name, file) where the package puts one of its own functions on another object: ``owner.name = f``
    or ``setattr(owner, "name", f)``, ``f`` a function or lambda of that file, ``owner`` not ``self``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        file, tree = path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8"))
        functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

        def ours(value: ast.expr, functions=functions) -> bool:
            return isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in functions)

        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and ours(node.value):
                targets = [t for t in node.targets if isinstance(t, ast.Attribute)]
                pairs = [(t.value, t.attr) for t in targets]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) == 3:
                named = isinstance(node.args[1], ast.Constant) and ours(node.args[2])
                pairs = [(node.args[0], node.args[1].value)] if named else []
            else:
                continue
            for owner, name in pairs:
                if not _private(name) and getattr(owner, "id", None) not in ("self", "cls"):
                    found.add((name, file))
    return found


def test_every_public_name_the_package_patches_is_listed_with_its_file():
    """A release that renames a method the package replaces (``accelerator.unwrap_model``) would leave ours
    uncalled, silently: each such patch is checked as the private names are."""
    listed = {(entry.name, file) for entry in INTERNALS for file in entry.used_by}
    patches = _patches()
    missing = sorted((n, f) for n, f in patches if (n, f) not in listed and n not in STDLIB_PATCHES)
    assert not missing, f"public names of other libraries patched but not in trainers/internals.py: {missing}"
    assert {("unwrap_model", "distributed/fast_ddp.py"), ("step", "supervision/nonfinite.py")} <= patches


def test_every_listed_internal_is_used_where_it_says():
    for entry in INTERNALS:
        assert entry.kind in internals.KINDS and entry.when in internals.CONDITIONS, entry.label
        for file in entry.used_by:
            text = (PACKAGE / file).read_text(encoding="utf-8")
            assert re.search(rf"\b{re.escape(entry.name)}\b", text), f"{entry.label} is not used in {file}"


def test_every_internal_holds_in_the_installed_releases():
    """Each entry, optional libraries' and features' too: what test-compat checks on other releases (whose venvs
    may lack TRL, whose entries are then left out)."""
    installed = [entry for entry in INTERNALS if importlib.util.find_spec(entry.library) is not None]
    assert {entry.library for entry in installed} >= {"transformers", "accelerate", "torch"}
    problems = {entry.label: internals.problem(entry) for entry in installed}
    assert {label: found for label, found in problems.items() if found is not None} == {}


def _arguments(tmp_path):
    return GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[])


def _build(args):
    import torch

    return GaudiTrainer(model=torch.nn.Linear(2, 2), args=args)


def test_a_missing_internal_fails_the_trainer_in_one_line_naming_it(tmp_path, monkeypatch):
    from accelerate.state import PartialState

    args = _arguments(tmp_path)  # accelerate's own device setup reads it too
    monkeypatch.delattr(PartialState, "_shared_state")
    with pytest.raises(InternalsError) as err:
        _build(args)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("accelerate.state.PartialState._shared_state is missing in accelerate ")
    assert "optimum_gaudi/distributed/fsdp.py relies on it" in message


def test_a_retyped_internal_fails_the_same_way(tmp_path, monkeypatch):
    import torch

    args = _arguments(tmp_path)
    monkeypatch.setattr(torch, "_foreach_copy_", 3)
    with pytest.raises(InternalsError, match=r"^torch\._foreach_copy_ is a int, no longer callable in torch "):
        _build(args)


def test_a_renamed_method_the_package_patches_fails_the_same_way(tmp_path, monkeypatch):
    from accelerate import Accelerator

    args = _arguments(tmp_path)
    monkeypatch.delattr(Accelerator, "unwrap_model")
    with pytest.raises(InternalsError) as err:
        _build(args)
    message = str(err.value)
    assert message.startswith("accelerate.Accelerator.unwrap_model is missing in accelerate ") and "\n" not in message
    assert "optimum_gaudi/distributed/fast_ddp.py relies on it" in message


def test_an_entry_of_a_feature_that_is_off_is_not_checked(tmp_path):
    entry = Internal("no_such_module_here", "_x", "callable", ("trainers/trainer.py",), "a test", "compile")
    off = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[])
    check_internals(off, GaudiConfig(), [entry])  # not due: nothing raised
    on = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], torch_compile=True)
    with pytest.raises(InternalsError, match="no_such_module_here cannot be loaded"):
        check_internals(on, GaudiConfig(), [entry])
