"""`python -m optimum_gaudi.launch ...` is `optimum-gaudi launch ...`: see optimum_gaudi/distributed/launch.py."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
