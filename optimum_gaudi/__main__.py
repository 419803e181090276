"""`python -m optimum_gaudi` runs the `optimum-gaudi` command."""

import sys

from .cli import main

sys.exit(main())
