"""Module paths from before the one-folder-per-concern layout (0.1), and from before precision had its folder,
kept importable for one more release.

An old path imports the module at its new home (the same module object, so patching either path patches
both) after one ``FutureWarning`` naming the new path. ``optimum_gaudi.trl`` stays a public name with no
warning: it mirrors ``optimum.habana.trl``. A finder at the end of ``sys.meta_path`` does this, instead of
one shim file per old path at the top of the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

REMOVED_IN = "0.3"

MOVED = {
    "optimum_gaudi.trainer": "optimum_gaudi.trainers.trainer",
    "optimum_gaudi.training_args": "optimum_gaudi.trainers.training_args",
    "optimum_gaudi.seq2seq": "optimum_gaudi.trainers.seq2seq",
    "optimum_gaudi.compat": "optimum_gaudi.trainers.compat",
    "optimum_gaudi.events": "optimum_gaudi.trainers.events",
    "optimum_gaudi.op_lists": "optimum_gaudi.precision.op_lists",
    "optimum_gaudi.hub": "optimum_gaudi.configuration.hub",
    "optimum_gaudi.host_memory": "optimum_gaudi.devices.host_memory",
    "optimum_gaudi.compilation": "optimum_gaudi.features.compilation",
    "optimum_gaudi.batching": "optimum_gaudi.features.static_batches",
    "optimum_gaudi.graphs": "optimum_gaudi.features.graphs",
    "optimum_gaudi.profiling": "optimum_gaudi.features.profiling",
    "optimum_gaudi.metrics": "optimum_gaudi.features.metrics",
    "optimum_gaudi.tasks": "optimum_gaudi.data.tasks",
    "optimum_gaudi.rouge": "optimum_gaudi.data.rouge",
    "optimum_gaudi.plot": "optimum_gaudi.cli.plot",
    "optimum_gaudi.distributed.launch": "optimum_gaudi.launch.launcher",
    # 0.2: the launcher left distributed/ (python -m optimum_gaudi.launch, 0.1's path, is launch/__main__.py)
    "optimum_gaudi.distributed.launcher": "optimum_gaudi.launch.launcher",
    "optimum_gaudi.distributed.launch_plan": "optimum_gaudi.launch.plan",
    "optimum_gaudi.distributed.torchrun": "optimum_gaudi.launch.torchrun",
    "optimum_gaudi.configuration.launch_env": "optimum_gaudi.launch.environment",
    # precision's modules before precision/ (optimum_gaudi.precision, 0.1's op-list autocast, is now its package)
    "optimum_gaudi.configuration.op_lists": "optimum_gaudi.precision.op_lists",
    "optimum_gaudi.configuration.fp8_recipe": "optimum_gaudi.precision.fp8_recipe",
    "optimum_gaudi.devices.autocast": "optimum_gaudi.precision.autocast",
    "optimum_gaudi.features.fp8": "optimum_gaudi.precision.fp8",
    "optimum_gaudi.features.op_list_check": "optimum_gaudi.precision.op_list_check",
    # 0.2: model preparation left features/: its pipeline for optimum_gaudi.preparation, its seams for optimum_gaudi.seam
    "optimum_gaudi.features.preparation": "optimum_gaudi.seam",
    # 0.2: run supervision in one folder
    "optimum_gaudi.trainers.preemption": "optimum_gaudi.supervision.preemption",
    "optimum_gaudi.trainers.nonfinite": "optimum_gaudi.supervision.nonfinite",
    "optimum_gaudi.trainers.watch": "optimum_gaudi.supervision.watch",
    "optimum_gaudi.trainers.stragglers": "optimum_gaudi.supervision.stragglers",
    "optimum_gaudi.distributed.watchdog": "optimum_gaudi.supervision.watchdog",
    "optimum_gaudi.distributed.agreement": "optimum_gaudi.supervision.agreement",
    "optimum_gaudi.distributed.collective_count": "optimum_gaudi.supervision.collective_count",
}
PUBLIC = {
    "optimum_gaudi.trl": "optimum_gaudi.trainers.trl",
    # optimum-habana's `optimum.habana.utils` (set_seed, check_optimum_habana_min_version, ...)
    "optimum_gaudi.utils": "optimum_gaudi.trainers.habana_compat",
}
# Old paths that are run with `python -m` (a job script may hold the command `launch --dry_run` printed).
RUNNABLE = ("optimum_gaudi.distributed.torchrun",)


def moved_message(old: str, new: str) -> str:
    return f"{old} moved to {new}; import it from there (the old path goes in optimum-gaudi {REMOVED_IN})."


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname in MOVED or fullname in PUBLIC:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        new = PUBLIC.get(old) or MOVED[old]
        if old not in PUBLIC:
            warnings.warn(moved_message(old, new), FutureWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(new)  # the import statement returns what sys.modules holds

    def get_code(self, fullname: str) -> CodeType:
        """What ``python -m OLD_PATH`` runs (runpy asks the loader for code): the new module, as ``__main__``."""
        new = MOVED.get(fullname, fullname)
        if fullname not in RUNNABLE:
            raise ImportError(f"{fullname} cannot be run with python -m; use {new}")
        source = (
            "import runpy, warnings\n"
            f"warnings.warn({f'python -m {fullname} is now python -m {new} (the old path goes in optimum-gaudi {REMOVED_IN}).'!r}, FutureWarning)\n"
            f"runpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{fullname}>", "exec")


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())  # last: a module that exists at a path always wins


def forward_moved_names(package: str, new_module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for a package that replaced a module of the same name: the names the old
    module had come from ``new_module``, after one ``FutureWarning`` (then kept in the package, so a
    ``from package import name``, which looks the name up twice, warns once). A module of the package that is
    not imported yet is left to the import system, without importing ``new_module`` on the way."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(new_module)
        if not hasattr(module, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(moved_message(f"{package}.{name}", f"{new_module}.{name}"), FutureWarning, stacklevel=2)
        value = getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
