"""Test helper run by the launcher: a script that refuses a flag it does not know (only --steps N), as the
examples do."""

import argparse

from optimum_gaudi.errors import quiet_argparse_errors, run_main


def main(argv: list[str] | None) -> None:
    parser = quiet_argparse_errors(argparse.ArgumentParser(prog="bad_flag.py"))
    parser.add_argument("--steps", type=int, default=1)
    parser.parse_args(argv)


if __name__ == "__main__":
    run_main(main)
