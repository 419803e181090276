"""The README's "Will it fit?" shows the real output of the command it shows (run here from the repository root)."""

from __future__ import annotations

import re
import shlex

from support import REPO

from optimum_gaudi.cli import main


def test_the_readme_shows_what_its_plan_command_prints(monkeypatch, capsys):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Will it fit?", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(optimum-gaudi plan .*?)\n```", section, flags=re.S)[1]
    shown = re.search(r"```text\n(.*?)\n```", section, flags=re.S)[1]
    monkeypatch.chdir(REPO)
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == shown
