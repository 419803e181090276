"""Room for one checkpoint on 2 processes with FSDP2's sharded checkpoints: every rank refuses before step 1 and
the launcher prints one line. The in-process checks: tests/unit/checkpoints/test_checkpoint_size.py."""

from __future__ import annotations

import tiny

from optimum_gaudi import GaudiTrainingArguments
from optimum_gaudi.trainers.checkpoint_size import estimate_checkpoint_size


def test_fsdp2_sharded_checkpoints_without_room_are_refused_before_step_1_in_one_line(tmp_path):
    """Issue 38, point 5: 2 processes, FSDP2 with sharded checkpoints, a disk with room for half a checkpoint:
    every rank refuses before step 1, and the launcher prints one line (was: a warning, then 2 steps and six
    tracebacks at the first save)."""
    import subprocess

    from support import SHARDED_FLAGS as FLAGS
    from support import SHARDED_SCRIPT as SCRIPT
    from support import SHARDED_WRAP as WRAP
    from support import job_environment, launch_command

    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to="none")
    half = estimate_checkpoint_size(tiny.llama(), args).total // 2
    config = tmp_path / "fsdp.json"
    config.write_text(f"{{{WRAP}}}")
    result = subprocess.run(
        launch_command("--world_size", "2", str(SCRIPT), str(tmp_path), f"room={half}")
        + ["--output_dir", str(tmp_path / "run"), *FLAGS, "--fsdp_config", str(config)],
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    command, *rest = result.stderr.splitlines()
    assert command.startswith("optimum-gaudi launch: ")
    errors = [line for line in rest if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "one checkpoint needs at least" in errors[0] and "(this node's share of the sharded checkpoint)" in errors[0]
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("checkpoint-*"))
