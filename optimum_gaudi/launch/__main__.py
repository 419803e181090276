"""``python -m optimum_gaudi.launch ARGS`` (0.1) is ``optimum-gaudi launch ARGS``, after one FutureWarning."""

import sys
import warnings

from .._legacy_paths import REMOVED_IN
from ..cli import main

warnings.warn(
    f"python -m optimum_gaudi.launch is now python -m optimum_gaudi launch (the old path goes in optimum-gaudi {REMOVED_IN}).",
    FutureWarning,
    stacklevel=1,
)
sys.exit(main(["launch", *sys.argv[1:]]))
