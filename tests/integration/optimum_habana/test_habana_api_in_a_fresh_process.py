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
