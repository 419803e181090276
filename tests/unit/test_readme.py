"""The README's commands run as written from the repository root (issue 9, point 8)."""

import os
import re
import shlex
import stat
import string

import pytest
from support import REPO

from optimum_gaudi.cli import main
from optimum_gaudi.launch import plan as launch_plan

ROOT = REPO
README = (ROOT / "README.md").read_text()


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def commands(block: str) -> tuple[dict[str, str], list[str]]:
    """The block's variable assignments and its other commands, continuation lines joined, comments cut."""
    joined = block.replace("\\\n", " ")
    variables, lines = {}, []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        assignment = re.fullmatch(r'([A-Z_]+)="(.*)"', line)
        if assignment:
            variables[assignment[1]] = assignment[2]
        elif line:
            lines.append(line)
    return variables, lines


def launch_lines() -> list[list[str]]:
    found = []
    for block in bash_blocks():
        variables, lines = commands(block)
        for line in lines:
            if line.startswith("optimum-gaudi launch"):
                expanded = string.Template(line).substitute(variables)
                found.append(shlex.split(expanded)[1:])
    return found


def test_every_script_the_readme_names_exists_from_the_repository_root():
    named = set(re.findall(r"[\w./-]+\.(?:py|json)\b", "\n".join(bash_blocks())))
    assert "examples/language-modeling/run_clm.py" in named
    for path in named:
        assert (ROOT / path).is_file(), f"README names {path}, which is not in the repository"


@pytest.fixture
def fake_launchers(tmp_path, monkeypatch):
    """Stand-ins for deepspeed and mpirun, which a dry run only looks up."""
    for name in ("deepspeed", "mpirun"):
        program = tmp_path / name
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(launch_plan, "_deepspeed_executable", lambda environ: str(tmp_path / "deepspeed"))


@pytest.mark.parametrize("argv", launch_lines(), ids=lambda argv: " ".join(a for a in argv if a.startswith("--use")))
def test_each_launch_example_is_accepted_from_the_repository_root(argv, fake_launchers, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main([argv[0], "--dry_run", *argv[1:]]) == 0, capsys.readouterr().err
    assert "examples/language-modeling/run_clm.py" in capsys.readouterr().out


def test_the_readme_keeps_its_multi_card_launch_examples():
    launchers = [argv for argv in launch_lines() if "--world_size" in argv]
    assert len(launchers) >= 4  # one server, several nodes, DeepSpeed, MPI
