"""Test helper run by the launcher: a script that refuses a flag it does not know, as the examples do.

    bad_flag.py [--steps N]
"""

import argparse

from optimum_gaudi.errors import quiet_argparse_errors, run_main


def main(argv: list[str] | None) -> None:
    parser = quiet_argparse_errors(argparse.ArgumentParser(prog="bad_flag.py"))
    parser.add_argument("--steps", type=int, default=1)
    parser.parse_args(argv)


if __name__ == "__main__":
    run_main(main)
