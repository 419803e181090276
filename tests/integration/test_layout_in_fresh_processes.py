"""The package layout's promises that need a fresh process: the launcher loads without torch, and the module
paths from before this layout still import and run (`python -m`). The import rules themselves:
tests/unit/test_layout.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import REPO

PACKAGE = REPO / "optimum_gaudi"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_launcher_loads_without_torch():
    """With Gaudi software 1.21+ `import torch` loads the bridge: the launcher (and the command line that parses its
    flags) must not, or the bridge would load in the launcher, before the environment it gives the ranks."""
    modules = sorted(module_name(p) for p in (PACKAGE / "launch").glob("*.py") if p.name != "__main__.py")
    code = (
        f"import importlib, sys\nfor name in {modules!r}: importlib.import_module(name)\n"
        "from optimum_gaudi.cli import build_parser\nbuild_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert "optimum_gaudi.launch.launcher" in modules and result.stdout.strip() == "[]"


def test_old_module_paths_and_names_keep_working_in_a_fresh_process():
    code = (
        "import warnings; warnings.simplefilter('error', FutureWarning)\n"
        "from optimum_gaudi.trl import GaudiSFTTrainer\n"  # public: no warning
        "from optimum_gaudi.features import feature_table\n"
        "from optimum_gaudi.configuration import GaudiConfig\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    from optimum_gaudi.training_args import GaudiTrainingArguments\n"
        "    from optimum_gaudi.configuration import bundled_config_names\n"
        "    from optimum_gaudi.data import default_tokenizer\n"
        "    from optimum_gaudi.precision import OpListAutocast\n"  # 0.1's module, now a package
        "moved = [x for x in w if 'moved to' in str(x.message)]\n"
        "print(len(moved), GaudiTrainingArguments.__module__, bundled_config_names.__module__, default_tokenizer.__module__,"
        " OpListAutocast.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.split() == [
        "4",
        "optimum_gaudi.trainers.training_args",
        "optimum_gaudi.configuration.gaudi_config",
        "optimum_gaudi.data.corpus",
        "optimum_gaudi.precision.autocast",
    ]


def test_python_dash_m_old_launch_path_still_runs_the_launcher():
    result = subprocess.run(
        [sys.executable, "-m", "optimum_gaudi.launch", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: optimum-gaudi launch")
    assert "python -m optimum_gaudi launch" in result.stderr


def test_python_dash_m_old_torchrun_path_still_runs_torchrun():
    """The command `optimum-gaudi launch --dry_run` printed before the launcher left distributed/ (a job script may
    hold it) still runs torchrun, after one warning."""
    result = subprocess.run(
        [sys.executable, "-m", "optimum_gaudi.distributed.torchrun", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0 and "torchrun" in result.stdout and "--nproc-per-node" in result.stdout
    assert "python -m optimum_gaudi.launch.torchrun" in result.stderr
