"""`optimum_gaudi.utils` (optimum-habana's `optimum.habana.utils`) is a public path that imports without a warning
in a fresh process. The API's other shapes: tests/unit/optimum_habana/test_habana_api.py."""

from __future__ import annotations

import subprocess
import sys

from support import REPO

# ---- optimum_gaudi.utils -------------------------------------------------------------------------------------


def test_utils_is_a_public_path_without_warning():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from optimum_gaudi.utils import set_seed, check_optimum_habana_min_version, adapt_transformers_to_gaudi\n"
        "print(set_seed.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["optimum_gaudi.trainers.habana_compat"]


# ---- a script that does not catch our errors ------------------------------------------------------------------


def test_an_unchanged_script_ends_on_the_one_line_a_refused_flag_gets_not_a_traceback(tmp_path):
    """optimum-habana's scripts parse their arguments with no handler of ours around them: a flag refused when the
    arguments are built (here lazy mode with FSDP; --fsdp on transformers 4.57.1) ends the script on its one line,
    as the project's own examples end; any other exception keeps its traceback."""
    refused = (
        "from transformers import HfArgumentParser\n"
        "from optimum_gaudi import GaudiTrainingArguments\n"
        f"HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(['--output_dir', r'{tmp_path}',"
        " '--use_lazy_mode', '--fsdp', 'full_shard', '--report_to', 'none'])\n"
    )
    run = subprocess.run([sys.executable, "-c", refused], capture_output=True, text=True, cwd=REPO)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: --use_lazy_mode cannot be combined with --fsdp:")
    bug = "from optimum_gaudi import GaudiTrainingArguments\nraise KeyError('a bug')\n"
    run = subprocess.run([sys.executable, "-c", bug], capture_output=True, text=True, cwd=REPO)
    assert "Traceback" in run.stderr and run.stderr.strip().endswith("KeyError: 'a bug'")
