"""optimum-gaudi launch: settings checked before anything starts (the command line each setting gives, the
hostfile, mpirun's and DeepSpeed's commands, the watch on node 0), and the DeepSpeed example configs. Real jobs
on loopback and failures that stop the whole job: tests/integration/launch/test_launch_jobs.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import sys
from pathlib import Path

import pytest
from conftest import FAKES
from support import LAUNCH_ENV, REPO, SCRIPTS

from optimum_gaudi.cli import main
from optimum_gaudi.launch import launcher
from optimum_gaudi.launch import plan as launch_plan
from optimum_gaudi.precision.op_lists import BF16_LIST_ENV, FP32_LIST_ENV, LIST_FILES_ENV

ALLREDUCE = SCRIPTS / "allreduce.py"
DEEPSPEED_CONFIGS = REPO / "examples" / "deepspeed"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The launcher reads MASTER_ADDR, ...; torchrun reads PET_* as defaults for its flags."""
    for name in [n for n in os.environ if n in LAUNCH_ENV or n.startswith(("PET_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the launcher started a process")

    monkeypatch.setattr(launcher, "run", refuse)
    monkeypatch.setattr(launcher.subprocess, "Popen", refuse)


def one_error_line(text: str) -> str:
    assert text.startswith("error: ") and text.count("\n") == 1, text
    assert "Traceback" not in text
    return text


def dry_run(capsys, *flags: str) -> list[str]:
    assert main(["launch", "--dry_run", *flags, str(ALLREDUCE), "--output_dir", "out"]) == 0
    return shlex.split(capsys.readouterr().out)


def value(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def hostfile(tmp_path, *lines: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# ---- settings: refused before anything starts -----------------------------------------------------------------

INCONSISTENT = [
    pytest.param(["--nnodes", "2"], {}, "need node 0's address", id="nodes-without-master-addr"),
    pytest.param(["--nnodes", "2", "--master_addr", "h", "--node_rank", "2"], {}, "node ranks go from 0 to 1", id="node-rank-too-big"),
    pytest.param(["--nnodes", "2", "--master_addr", "h"], {"NODE_RANK": "2"}, "NODE_RANK (environment) is 2", id="env-node-rank-too-big"),
    pytest.param([], {"NODE_RANK": "first"}, "NODE_RANK (environment) must be a whole number", id="env-node-rank-not-a-number"),
    pytest.param(["--node_rank", "-1"], {}, "--node_rank must be >= 0", id="negative-node-rank"),
    pytest.param([], {"MASTER_PORT": "http"}, "MASTER_PORT (environment) must be a whole number", id="env-port-not-a-number"),
    pytest.param(["--master_port", "70000"], {}, "--master_port must be from 1 to 65535", id="port-too-big"),
    pytest.param([], {"MASTER_PORT": "0"}, "MASTER_PORT (environment) must be from 1 to 65535", id="env-port-zero"),
    pytest.param(["--world_size", "2"], {"WORLD_SIZE": "3"}, "WORLD_SIZE=3 (environment) but 1 node(s) x 2", id="world-size-disagrees"),
    pytest.param(["--nnodes", "2", "--master_addr", "h"], {"WORLD_SIZE": "3"}, "does not split over 2 nodes", id="world-size-indivisible"),
    pytest.param([], {"WORLD_SIZE": "two"}, "WORLD_SIZE (environment) must be a whole number", id="env-world-size-not-a-number"),
    pytest.param(["--world_size", "0"], {}, "--world_size must be >= 1", id="no-process"),
    pytest.param(["--nnodes", "1:2"], {}, "--nnodes must be a whole number", id="elastic-range"),
    pytest.param(["--use_deepspeed", "--use_mpi"], {}, "exclude each other", id="two-launchers"),
    pytest.param(["--use_mpi", "--nnodes", "2", "--master_addr", "h"], {}, "needs --hostfile", id="mpi-nodes-without-hostfile"),
    pytest.param(["--use_deepspeed", "--nnodes", "2", "--master_addr", "h"], {}, "needs --hostfile", id="deepspeed-nodes-without-hostfile"),
]  # fmt: skip


@pytest.mark.parametrize("flags, environment, message", INCONSISTENT)
def test_inconsistent_settings_are_one_error_line_before_anything_starts(
    flags, environment, message, monkeypatch, capsys, nothing_starts
):
    for name, text in environment.items():
        monkeypatch.setenv(name, text)
    assert main(["launch", *flags, str(ALLREDUCE)]) == 2
    assert message in one_error_line(capsys.readouterr().err)


def test_a_missing_script_is_one_error_line(tmp_path, capsys, nothing_starts):
    assert main(["launch", "--world_size", "2", str(tmp_path / "train.py")]) == 2
    assert f"training script not found: {tmp_path / 'train.py'}" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "lines, flags, message",
    [
        (["node1 slots=8"], [], "--hostfile needs --use_deepspeed or --use_mpi"),
        (["node1 slots=8", "node2 gpus=8"], ["--use_mpi"], "line 2: expected 'HOST slots=N'"),
        (["node1 slots=8", "node1 slots=8"], ["--use_mpi"], "lists node1 twice"),
        (["# nothing yet"], ["--use_mpi"], "lists no host"),
        (["node1 slots=8"], ["--use_mpi", "--nnodes", "2"], "--nnodes 2 but --hostfile"),
        (["node1", "node2"], ["--use_mpi", "--node_rank", "1"], "run the launcher there only, without --node_rank"),
    ],
)
def test_hostfile_problems_are_one_error_line(tmp_path, capsys, nothing_starts, lines, flags, message):
    assert main(["launch", "--hostfile", hostfile(tmp_path, *lines), *flags, str(ALLREDUCE)]) == 2
    assert message in one_error_line(capsys.readouterr().err)


def test_use_mpi_without_mpirun_says_what_to_install(tmp_path, monkeypatch, capsys, nothing_starts):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no mpirun
    assert main(["launch", "--use_mpi", "--world_size", "2", str(ALLREDUCE)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "'mpirun'" in err and "Open MPI" in err


def test_use_deepspeed_without_deepspeed_says_what_to_install(monkeypatch, capsys, nothing_starts):
    real_find_spec = importlib.util.find_spec  # DeepSpeed is in the tests extra: hide it
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real_find_spec(n, *a))
    assert main(["launch", "--use_deepspeed", "--world_size", "2", str(ALLREDUCE)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "pip install deepspeed" in err and "HabanaAI/DeepSpeed" in err


# ---- settings: where each one comes from -----------------------------------------------------------------------


def test_one_node_defaults(capsys):
    command = dry_run(capsys)
    assert command[:3] == [sys.executable, "-m", "optimum_gaudi.launch.torchrun"]  # torchrun, no traceback
    options = ("--nnodes", "--nproc_per_node", "--node_rank", "--master_addr")
    assert [value(command, o) for o in options] == ["1", "1", "0", "127.0.0.1"]
    assert 1 <= int(value(command, "--master_port")) <= 65535  # a free one, chosen for this run
    assert value(command, "--max_restarts") == "0" and value(command, "--rdzv_backend") == "static"
    assert command[-3:] == [str(ALLREDUCE), "--output_dir", "out"]


def test_max_restarts_uses_a_rendezvous_that_can_run_again(capsys):
    command = dry_run(capsys, "--max_restarts", "3")
    assert value(command, "--max_restarts") == "3" and value(command, "--rdzv_backend") == "c10d"
    assert value(command, "--rdzv_endpoint").startswith("127.0.0.1:")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use_mpi", "--max_restarts", "1"], "--max_restarts needs torchrun's elastic agent: drop --use_mpi"),
        (["--max_restarts", "-1"], "--max_restarts must be >= 0, got -1"),
        (["--use_deepspeed", "--grace_period", "60"], "--grace_period is torchrun's stop timeout"),
        (["--grace_period", "0"], "--grace_period must be >= 1, got 0"),
    ],
)
def test_restart_and_grace_settings_that_cannot_work_are_refused(monkeypatch, capsys, nothing_starts, flags, message):
    monkeypatch.setattr(launch_plan.shutil, "which", lambda *a, **k: "/usr/bin/mpirun")
    monkeypatch.setattr(launch_plan, "_deepspeed_executable", lambda env: "deepspeed")
    assert main(["launch", *flags, str(ALLREDUCE)]) != 0
    assert message in one_error_line(capsys.readouterr().err)


def test_environment_fills_what_the_flags_leave_out(monkeypatch, capsys):
    for name, text in {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "NODE_RANK": "1", "WORLD_SIZE": "16"}.items():
        monkeypatch.setenv(name, text)
    command = dry_run(capsys, "--nnodes", "2")
    assert value(command, "--nproc_per_node") == "8"  # WORLD_SIZE counts every process: 16 over 2 nodes
    assert value(command, "--node_rank") == "1"
    assert (value(command, "--master_addr"), value(command, "--master_port")) == ("10.0.0.1", "1234")


def test_flags_override_the_environment(monkeypatch, capsys):
    for name, text in {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "NODE_RANK": "1", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, text)
    command = dry_run(capsys, *"--nnodes 2 --world_size 2 --node_rank 0 --master_addr node0 --master_port 999".split())
    options = ("--nproc_per_node", "--node_rank", "--master_addr", "--master_port")
    assert [value(command, o) for o in options] == ["2", "0", "node0", "999"]


def test_several_nodes_agree_on_the_default_port(capsys):
    command = dry_run(capsys, "--nnodes", "2", "--master_addr", "node0", "--nproc_per_node", "8")
    assert value(command, "--master_port") == "29500" and value(command, "--nproc_per_node") == "8"


def test_script_arguments_are_passed_on_untouched(capsys):
    args = ["--world_size", "3", "-h", "--master_port=1", "a b"]
    assert main(["launch", "--dry_run", "--world_size", "2", str(ALLREDUCE), *args]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[-6:] == [str(ALLREDUCE), *args] and value(command, "--nproc_per_node") == "2"


def test_deepspeed_over_ssh_from_a_hostfile_and_per_node_with_a_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch_plan, "_deepspeed_executable", lambda environ: "/opt/bin/deepspeed")
    hosts = hostfile(tmp_path, "# two Gaudi servers", "gaudi-a slots=8", "gaudi-b slots=8")
    command = dry_run(capsys, "--use_deepspeed", "--hostfile", hosts, "--world_size", "8")
    assert command[:13] == [
        "/opt/bin/deepspeed", "--num_nodes", "2", "--num_gpus", "8", "--master_addr", "gaudi-a",
        "--master_port", "29500", "--no_local_rank", "--hostfile", hosts, str(ALLREDUCE),
    ]  # fmt: skip
    monkeypatch.setenv("NODE_RANK", "1")  # each node starts its own share: no ssh
    command = dry_run(capsys, "--use_deepspeed", "--hostfile", hosts, "--world_size", "8")
    assert command[command.index("--hostfile") :][:5] == ["--hostfile", hosts, "--no_ssh", "--node_rank", "1"]


def test_deepspeed_on_one_node():
    plan = launch_plan.LaunchPlan("deepspeed", "train.py", ("--deepspeed", "zero2.json"), 8, executable="deepspeed")
    assert launch_plan.build_command(plan) == [
        "deepspeed", "--num_nodes", "1", "--num_gpus", "8", "--master_addr", "127.0.0.1", "--master_port", "29500",
        "--no_local_rank", "train.py", "--deepspeed", "zero2.json",
    ]  # fmt: skip


def test_mpirun_commands(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    plan = launch_plan.LaunchPlan("mpi", "train.py", ("--bf16",), 8, master_port=1234, executable="/usr/bin/mpirun")
    assert launch_plan.build_command(plan, python="python", environ={}) == [
        "/usr/bin/mpirun", "-n", "8", "--bind-to", "none", "-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=1234",
        "python", "-u", "-c", launch_plan.MPI_WORKER, "train.py", "--bf16",
    ]  # fmt: skip
    plan = launch_plan.LaunchPlan("mpi", "train.py", (), 8, nnodes=2, master_addr="a", hostfile="hosts", per_node=False)
    command = launch_plan.build_command(
        plan, python="python", environ={"PYTHONPATH": "/src", "HCCL_X": "1", "HOME": "/"}
    )
    assert command[:7] == ["mpirun", "-n", "16", "--hostfile", "hosts", "--map-by", "ppr:8:node"]
    assert command[7:11] == ["-x", "HCCL_X", "-x", "PYTHONPATH"]  # what the other hosts need; HOME is theirs
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "--allow-run-as-root" in launch_plan.build_command(plan, python="python", environ={})


def test_mpirun_forwards_the_bridge_variables_to_the_other_nodes(tmp_path, monkeypatch, capsys):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.syspath_prepend(FAKES)  # a bridge is installed here: its variables must reach every node
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)  # the arguments decide it, not an earlier test's export
    for name, text in {"FI_PROVIDER": "efa", "HF_HUB_OFFLINE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}.items():
        monkeypatch.setenv(name, text)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1,2,3")
    monkeypatch.setenv("HABANA_VISIBLE_DEVICES", "all")
    hosts = hostfile(tmp_path, "gaudi-a slots=8", "gaudi-b slots=8")
    flags = ["--use_mpi", "--hostfile", hosts, "--world_size", "8", str(ALLREDUCE), "--gaudi_config_name", "gpt2"]
    flags.append("--use_lazy_mode")  # the launcher sets PT_HPU_LAZY_MODE only when the arguments ask for a mode
    assert main(["launch", "--dry_run", *flags]) == 0
    words = shlex.split(capsys.readouterr().out)
    exported = dict(word.split("=", 1) for word in words[: words.index(str(tmp_path / "bin" / "mpirun"))])
    forwarded = {words[i + 1] for i, word in enumerate(words) if word == "-x"}
    assert {"PT_HPU_LAZY_MODE", BF16_LIST_ENV, FP32_LIST_ENV, LIST_FILES_ENV} <= set(exported) <= forwarded
    assert {"FI_PROVIDER", "HF_HUB_OFFLINE", "TORCH_DEVICE_BACKEND_AUTOLOAD"} <= forwarded
    assert not {"HABANA_VISIBLE_MODULES", "HABANA_VISIBLE_DEVICES"} & forwarded  # each node has its own
    files = json.loads(exported[LIST_FILES_ENV])  # what the worker writes on a node that lacks the files
    assert files[exported[BF16_LIST_ENV]] == Path(exported[BF16_LIST_ENV]).read_text()


# ---- reading a failure -----------------------------------------------------------------------------------------

TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fault.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2025-01-01_00:00:00
  host      : localhost
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 101)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 101
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_00:00:00
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 102)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 102
============================================================
"""


def test_failure_summary_names_torchruns_root_cause():
    plan = launch_plan.LaunchPlan("torchrun", "fault.py", nproc_per_node=2, nnodes=2, node_rank=1, master_addr="a")
    assert launcher.describe_failure(plan, "log\n" + TORCHRUN_REPORT, 1) == (
        "rank 3 (local rank 1 on node 1) was killed by SIGKILL; torchrun stopped the other ranks of this node"
    )
    agent_line = "E0101 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 102) of binary: python\n"
    assert launcher.describe_failure(plan, agent_line, 1).startswith(
        "rank 3 (local rank 1 on node 1) exited with code 1"
    )
    assert launcher.describe_failure(plan, "no report", 1) == (
        "torchrun exited with code 1 on node 1; the failed rank's output is above"
    )


def test_master_watch_waits_for_node_0_to_have_been_up_then_counts_refusals(monkeypatch):
    monkeypatch.setattr(launcher, "MASTER_WATCH_INTERVAL", 0.0)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    watch = launcher._MasterWatch("127.0.0.1", port)
    assert not watch.gone(workers_started=False) and watch.was_up
    server.close()
    verdicts = [watch.gone(workers_started=True) for _ in range(launcher.MASTER_WATCH_MISSES)]
    assert verdicts == [False] * (launcher.MASTER_WATCH_MISSES - 1) + [True]

    never_up = launcher._MasterWatch("127.0.0.1", port)  # node 0 not started yet: wait for it, however long
    assert not any(never_up.gone(workers_started=False) for _ in range(2 * launcher.MASTER_WATCH_MISSES))
    assert never_up.gone(workers_started=True)  # this node's rendezvous passed, so node 0 was up, and is gone


# ---- DeepSpeed example configs ---------------------------------------------------------------------------------

# The keys transformers' DeepSpeed integration fills when they say "auto" (HfTrainerDeepSpeedConfig).
FILLED_BY_TRANSFORMERS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
}  # fmt: skip


def auto_keys(config: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, item in config.items():
        if isinstance(item, dict):
            keys |= auto_keys(item, f"{prefix}{key}.")
        elif item == "auto":
            keys.add(prefix + key)
    return keys


def test_deepspeed_configs_cover_zero_1_2_3_and_offload():
    names = sorted(p.name for p in DEEPSPEED_CONFIGS.glob("*.json"))
    assert names == ["zero1.json", "zero2.json", "zero2_offload.json", "zero3.json"]
    readme = (DEEPSPEED_CONFIGS / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in names) and "--deepspeed" in readme
    assert "pip install git+https://github.com/HabanaAI/DeepSpeed.git@" in readme


@pytest.mark.parametrize("path", sorted(DEEPSPEED_CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_deepspeed_config(path):
    config = json.loads(path.read_text())
    assert config["bf16"]["enabled"] is True
    assert config["zero_optimization"]["stage"] == int(re.match(r"zero(\d)", path.name).group(1))
    assert {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"} <= auto_keys(config)
    assert auto_keys(config) <= FILLED_BY_TRANSFORMERS  # any other "auto" would reach DeepSpeed unfilled
    offloaded = {k: v for k, v in config["zero_optimization"].items() if k.startswith("offload_")}
    assert (path.stem.endswith("_offload")) == bool(offloaded)
    assert all(target["device"] == "cpu" for target in offloaded.values())


def test_deepspeed_over_ssh_gets_the_bridge_environment_through_a_private_env_file(tmp_path, monkeypatch, bridge):
    """DeepSpeed's runner forwards only a few prefixes over ssh, plus the lines of the file DS_ENV_FILE names
    (deepspeed/launcher/runner.py): lazy mode and the op-list variables must reach the other nodes that way."""
    program = tmp_path / "deepspeed"
    seen = tmp_path / "seen.txt"  # what the fake deepspeed found in the file it was pointed at
    program.write_text(f'#!/bin/sh\nls -l "$DS_ENV_FILE" | cut -c1-10 > {seen}\ncat "$DS_ENV_FILE" >> {seen}\n')
    program.chmod(0o700)
    monkeypatch.setattr(launch_plan, "_deepspeed_executable", lambda environ: str(program))
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("MY_SETTING=kept\n")  # the user's own file must still apply
    monkeypatch.setattr(launch_plan, "_DEEPSPEED_USER_FILES", (home / ".deepspeed_env",))
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1")
    hosts = hostfile(tmp_path, "gaudi-a slots=8", "gaudi-b slots=8")
    flags = ["--use_deepspeed", "--hostfile", hosts, "--world_size", "8", "--master_port", "29517"]
    assert main(["launch", *flags, str(ALLREDUCE), "--use_lazy_mode", "--gaudi_config_name", "gpt2"]) == 0
    mode, *lines = seen.read_text().splitlines()
    assert mode == "-rw-------"  # only this user reads what the job's environment holds
    assert lines[0] == "MY_SETTING=kept"
    forwarded = dict(line.split("=", 1) for line in lines)
    assert forwarded["PT_HPU_LAZY_MODE"] == "1" and "HABANA_VISIBLE_MODULES" not in forwarded  # each node's own
    assert {BF16_LIST_ENV, FP32_LIST_ENV} <= set(forwarded)
