"""optimum-gaudi launch in real processes: jobs on loopback (gloo) and through mpirun, failures that stop the whole
job, restarts, the MPI worker, `python -m` refusing in one line. The settings checked before anything starts and
the DeepSpeed example configs: tests/unit/launch/test_launch_settings.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import LAUNCH_ENV, REPO, SCRIPTS, job_environment, launch_command

from optimum_gaudi.launch import plan as launch_plan
from optimum_gaudi.precision.op_lists import LIST_FILES_ENV

ALLREDUCE = SCRIPTS / "allreduce.py"
FAULT = SCRIPTS / "fault.py"
BAD_FLAG = SCRIPTS / "bad_flag.py"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The launcher reads MASTER_ADDR, ...; torchrun reads PET_* as defaults for its flags."""
    for name in [n for n in os.environ if n in LAUNCH_ENV or n.startswith(("PET_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)


def one_error_line(text: str) -> str:
    assert text.startswith("error: ") and text.count("\n") == 1, text
    assert "Traceback" not in text
    return text


def test_python_dash_m_launch_refuses_with_exit_code_2_and_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "optimum_gaudi", "launch", "--nnodes", "2", str(ALLREDUCE)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2
    assert "need node 0's address" in one_error_line(result.stderr)
    assert result.stdout == ""


def test_mpi_worker_writes_the_op_list_files_its_node_lacks(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(open(os.environ['PT_HPU_AUTOCAST_FP32_OPS_LIST']).read(), end='')\n")
    lists = tmp_path / "elsewhere" / "fp32.txt"  # the launcher's /tmp, not this node's
    env = {
        **os.environ,
        "PT_HPU_AUTOCAST_FP32_OPS_LIST": str(lists),
        LIST_FILES_ENV: json.dumps({str(lists): "softmax\n"}),
    }
    result = subprocess.run(
        [sys.executable, "-c", launch_plan.MPI_WORKER, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "softmax\n"


def test_mpi_worker_gives_each_rank_the_torch_variables(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys\n"
        "names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK')\n"
        "print(json.dumps([sys.argv, sys.path[0], __name__, [os.environ.get(n) for n in names]]))\n"
    )
    ompi = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    ompi |= {"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "2"}  # Open MPI's: within the node
    result = subprocess.run(
        [sys.executable, "-c", launch_plan.MPI_WORKER, str(script), "--x", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, **ompi},
        cwd=REPO,
        check=True,
        timeout=60,
    )
    argv, path0, name, values = json.loads(result.stdout)
    assert argv == [str(script), "--x", "1"] and path0 == str(tmp_path) and name == "__main__"
    assert values == ["6", "8", "2", "4", "1"]  # GROUP_RANK: torchrun's meaning, the node's index


# ---- real jobs on loopback -------------------------------------------------------------------------------------


def records(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]


def job_pids(directory: Path) -> list[int]:
    """Each rank's pid and its torchrun agent's, as tests/scripts/fault.py wrote them."""
    return [int(pid) for path in directory.glob("pids*") for pid in path.read_text().split()]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if running(pid)], "processes of the job outlived the launcher"


def test_two_processes_all_reduce_on_one_node(tmp_path):
    result = subprocess.run(
        launch_command("--world_size", "2", str(ALLREDUCE), str(tmp_path), "--flag", "value"),
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("optimum-gaudi launch: ")  # the command it ran, for the log
    ranks = records(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in ranks)  # (0 + 1) + (1 + 1)
    assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["0", "1"]  # what transformers.Trainer reads
    assert all(r["argv"] == [str(tmp_path), "--flag", "value"] for r in ranks)


def test_two_nodes_of_one_process_on_loopback(tmp_path):
    port = str(launch_plan.free_port())
    nodes = [
        subprocess.Popen(
            launch_command(
                "--nnodes", "2", "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port
            )
            + ["--world_size", "1", str(ALLREDUCE), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=job_environment(),
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    ranks = records(tmp_path)
    assert [(r["rank"], r["world_size"], r["sum"], r["env"]["LOCAL_RANK"]) for r in ranks] == [
        (0, 2, 3.0, "0"),
        (1, 2, 3.0, "0"),
    ]


@pytest.mark.parametrize("mode, how", [("raise", "exited with code 1"), ("kill", "was killed by SIGKILL")])
def test_a_failed_rank_stops_the_job_and_is_named(tmp_path, mode, how):
    start = time.monotonic()
    result = subprocess.run(
        launch_command("--world_size", "2", str(FAULT), mode, str(tmp_path)),
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=120,
    )
    assert time.monotonic() - start < 60
    assert result.returncode != 0
    last_line = result.stderr.rstrip().splitlines()[-1]
    assert last_line.startswith("error: rank 1 (local rank 1 on node 0) " + how), result.stderr[-3000:]
    pids = job_pids(tmp_path)
    assert len(pids) == 4  # both ranks got as far as writing theirs: rank 0 was waiting in its all_reduce
    assert_all_gone(pids)


def test_a_user_error_on_the_ranks_is_the_scripts_own_line_and_exit_status(tmp_path):
    """A bad flag fails on every rank: the launcher prints the line the script alone prints, once, and exits 2
    (not each rank's line and torchrun's, exit 1)."""
    alone = subprocess.run(
        [sys.executable, str(BAD_FLAG), "--bad_flag"], capture_output=True, text=True, env=job_environment()
    )
    assert alone.returncode == 2 and len(alone.stderr.splitlines()) == 1, alone.stderr
    unset = {k: v for k, v in job_environment().items() if k != "OMP_NUM_THREADS"}  # torchrun's banner, if unset
    result = subprocess.run(
        launch_command("--world_size", "2", str(BAD_FLAG), "--bad_flag"),
        capture_output=True,
        text=True,
        env=unset,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    command, *rest = result.stderr.splitlines()
    assert command.startswith("optimum-gaudi launch: ")  # the command it ran, for the log
    assert rest == alone.stderr.splitlines()


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    job = subprocess.Popen(
        launch_command("--world_size", "2", str(FAULT), "hang", str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pids*"))) < 2 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        time.sleep(0.2)  # the second file may be half written
        pids = job_pids(tmp_path)
        assert len(pids) == 4, job.stderr.read() if job.poll() is not None else "ranks did not start in 60 s"
        start = time.monotonic()
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert time.monotonic() - start < 60
    assert job.returncode == 128 + signal.SIGTERM
    assert err.rstrip().splitlines()[-1] == "error: received SIGTERM; the job was stopped"
    assert_all_gone(pids)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_two_processes_all_reduce_through_mpirun(tmp_path):
    result = subprocess.run(
        launch_command("--use_mpi", "--world_size", "2", str(ALLREDUCE), str(tmp_path)),
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ranks = records(tmp_path)
    assert [(r["rank"], r["world_size"], r["sum"], r["env"]["LOCAL_RANK"]) for r in ranks] == [
        (0, 2, 3.0, "0"),
        (1, 2, 3.0, "1"),
    ]


# ---- a dead rank: torchrun's elastic agent restarts the job, which resumes on its own (issue 21, point 6) -------

RESTARTABLE = SCRIPTS / "train_restartable.py"
_TRAIN_FLAGS = (
    "--max_steps", "8", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
    "--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true",
)  # fmt: skip


def _launch_training(tmp_path, *launcher_flags: str, results: Path, die_at: int, output_dir: Path, extra=()):
    return subprocess.run(
        launch_command("--world_size", "2", *launcher_flags, str(RESTARTABLE), str(results), str(die_at))
        + ["--output_dir", str(output_dir), *_TRAIN_FLAGS, *extra],
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=240,
    )


def test_max_restarts_resumes_after_a_rank_dies_as_a_hand_resumed_run_would(tmp_path):
    import safetensors.torch
    import torch

    elastic, by_hand = tmp_path / "elastic", tmp_path / "by_hand"
    elastic.mkdir()
    by_hand.mkdir()
    # rank 1 is killed (SIGKILL) when step 5 ends; checkpoints every 2 steps: the job restarts from checkpoint-4
    result = _launch_training(tmp_path, "--max_restarts", "1", results=elastic, die_at=5, output_dir=elastic / "run")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Restart 1 of this job: resuming from" in result.stderr
    restarted = json.loads((elastic / "result-1.json").read_text())
    assert restarted["resumed_from"] == str(elastic / "run" / "checkpoint-4")
    assert restarted["global_step"] == 8
    assert not (elastic / "result-0.json").exists()  # the first attempt never finished

    shutil.copytree(elastic / "run" / "checkpoint-4", by_hand / "run" / "checkpoint-4")
    result = _launch_training(
        tmp_path, results=by_hand, die_at=0, output_dir=by_hand / "run", extra=("--resume_from_checkpoint", "true")
    )
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = json.loads((by_hand / "result-0.json").read_text())
    assert resumed["losses"] == restarted["losses"]
    a = safetensors.torch.load_file(elastic / "weights-1.safetensors")
    b = safetensors.torch.load_file(by_hand / "weights-0.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_rank_ends_in_the_launchers_line_without_torchruns_traceback(tmp_path):
    result = subprocess.run(
        launch_command("--world_size", "2", str(FAULT), "raise", str(tmp_path)),
        capture_output=True,
        text=True,
        env=job_environment(),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr  # the rank's own error stays
    assert "ChildFailedError" not in result.stderr and "Root Cause" not in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == (
        "error: rank 1 (local rank 1 on node 0) exited with code 1; torchrun stopped the other ranks of this node"
    )
