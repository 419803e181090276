"""One clear line for a user's mistake, never a traceback: the error type to raise and the wrapper to run.

A script's ``main`` raises :class:`UserError` (or a subclass) for anything the user can fix, with a message
that is one line saying what is wrong and what to do; :func:`run_main` prints it as ``error: ...`` on stderr
and exits with status 2. Everything else is a bug and keeps its traceback. Usage in an example script::

    from optimum_gaudi.errors import UserError, quiet_argparse_errors, run_main

    def main(argv: list[str] | None = None) -> None:
        parser = quiet_argparse_errors(HfArgumentParser(...))   # a bad flag: one line, not a page of usage
        ...
        if args.block_size < 1:
            raise UserError(f"--block_size must be >= 1, got {args.block_size}.")

    if __name__ == "__main__":
        run_main(main)

Tests call :func:`call_main` instead, which returns the exit status without leaving the interpreter.

What counts as a user error:
- :class:`UserError` and its subclasses; the package's own user-facing errors derive from it
  (``GaudiConfigError``, ``GaudiArgumentError``, ``HubUnavailableError``, ``NoGaudiError``, ``LaunchError``);
- an ``OSError`` from the file system the user pointed at (no space left, read-only, permission denied, not a
  directory, ...), reported with the path it names;
- Ctrl-C: ``interrupted`` and exit status 130.

Under ``optimum-gaudi launch`` every rank would print the same line (a bad flag fails on each): there the
first rank's line goes to the file the launcher names in ``OPTIMUM_GAUDI_LAUNCH_USER_ERROR``, and the launcher
prints it once, exit status 2, as the script alone would.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

EXIT_USER_ERROR = 2  # as argparse uses for a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
LAUNCH_USER_ERROR_ENV = "OPTIMUM_GAUDI_LAUNCH_USER_ERROR"  # set by optimum-gaudi launch for its ranks

# File-system errors that come from where the user asked to read or write, not from a bug.
_USER_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
    errno.ENAMETOOLONG: "file name too long",
}


class UserError(Exception):
    """Something the user asked for that cannot work; the message is one line saying what to change."""


class CommandError(UserError):
    """A problem an ``optimum-gaudi`` subcommand reports as one ``error: ...`` line, exit code 2."""


def one_line(text: str) -> str:
    """The message squeezed onto one line (a user error must be a single line on the terminal)."""
    return " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions behind it (``__cause__``, else ``__context__``), outermost first: libraries
    wrap the error that says what is wrong (a parser's, the OS's) in their own."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message for a user error, or None when ``exc`` is a bug that deserves its traceback."""
    if isinstance(exc, UserError):
        return one_line(str(exc))
    if isinstance(exc, OSError) and exc.errno in _USER_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        return one_line(f"{_USER_ERRNOS[exc.errno]}{where}: {exc.strerror or exc}")
    return None


def call_main(main: Callable[..., Any], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` and return the exit status: 0, 2 after one ``error:`` line for a user error, 130 on
    Ctrl-C; a bug propagates with its traceback. ``main`` may also raise SystemExit (its code is returned)."""
    try:
        main(None if argv is None else list(argv))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        message = user_error_message(e)
        if message is None:
            raise
        _close_progress_bars()
        if not _left_for_the_launcher(message):
            print(f"error: {message}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


def _left_for_the_launcher(message: str) -> bool:
    """Under optimum-gaudi launch: leave the line for the launcher to print (the first rank's only); False
    where there is no launcher to print it."""
    path = os.environ.get(LAUNCH_USER_ERROR_ENV)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return True  # another rank's line is there
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(message)
    return True


def _close_progress_bars() -> None:
    """A failed training leaves its tqdm bar open; closed at exit it would redraw below the error line."""
    tqdm = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:
            pass


def install_excepthook() -> None:
    """A script that does not catch our errors (optimum-habana's, unchanged but for their imports) ends on a
    UserError's one line, as the project's own examples end, not on a traceback ending in it; every other
    exception keeps its traceback (the hook before ours prints it)."""
    previous = sys.excepthook
    if getattr(previous, "prints_user_errors", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, traceback: Any) -> None:
        if not isinstance(exc, UserError):
            previous(kind, exc, traceback)
            return
        _close_progress_bars()
        message = one_line(str(exc))
        if not _left_for_the_launcher(message):
            print(f"error: {message}", file=sys.stderr, flush=True)

    hook.prints_user_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def run_main(main: Callable[..., Any], argv: Sequence[str] | None = None) -> NoReturn:
    """The ``if __name__ == "__main__":`` line of a script: :func:`call_main`, then exit with its status."""
    sys.exit(call_main(main, argv))


_INVALID_CHOICE = re.compile(r"^(?P<head>.*invalid choice: )(?P<value>'.*?') \(choose from (?P<choices>.*)\)$", re.S)
_MAX_CHOICES_SHOWN = 8


def _shorten_argparse_message(message: str) -> str:
    """argparse lists every choice of a bad choice (hundreds for --model_type): name the closest few instead."""
    found = _INVALID_CHOICE.match(message)
    if not found:
        return message
    choices = [c.strip().strip("'\"") for c in found.group("choices").split(",")]
    if len(choices) <= _MAX_CHOICES_SHOWN:
        return message
    value = found.group("value").strip("'\"")
    close = difflib.get_close_matches(value, choices, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    return f"{found.group('head')}{found.group('value')} ({hint}--help lists all {len(choices)} choices)"


def quiet_argparse_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` raise :class:`UserError` on a bad command line instead of printing its whole usage
    (run_clm.py's is 143 lines) and exiting; ``--help`` still prints everything. Returns the parser."""

    def error(message: str) -> NoReturn:
        message = _shorten_argparse_message(message)
        raise UserError(f"{parser.prog}: {message}{'' if '--help' in message else ' (see --help)'}")

    parser.error = error  # type: ignore[method-assign]
    return parser


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """A logger's warnings held back (its errors still shown) while the block runs."""
    held = logging.getLogger(name)
    level = held.level
    held.setLevel(logging.ERROR)
    try:
        yield
    finally:
        held.setLevel(level)
