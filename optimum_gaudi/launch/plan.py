"""Run a training script on several processes, cards and nodes: ``optimum-gaudi launch``.

    optimum-gaudi launch --world_size 8 run_clm.py ARGS...                  one server, 8 cards
    optimum-gaudi launch --world_size 8 --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 run_clm.py ARGS...
    optimum-gaudi launch --world_size 8 --use_deepspeed run_clm.py --deepspeed ds_config.json ARGS...
    optimum-gaudi launch --world_size 8 --use_mpi run_clm.py ARGS...

By default the processes are started by torchrun (``python -m torch.distributed.run``, static rendezvous at
MASTER_ADDR:MASTER_PORT, no restarts; with ``--max_restarts N`` torchrun's c10d rendezvous there, which can
meet again: the job restarts after a dead rank and resumes from its newest complete checkpoint);
``--use_deepspeed`` starts them with DeepSpeed's ``deepspeed`` launcher and ``--use_mpi`` with Open MPI's
``mpirun``. Each process gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in its environment, which is all ``transformers.Trainer`` needs.

``--world_size`` is the number of processes on each node (one per card): the meaning it has in optimum-habana's
``gaudi_spawn.py``; ``--nproc_per_node`` is the same option under torchrun's name. The ``WORLD_SIZE`` environment
variable keeps torch's meaning, every process of the job: nodes x processes per node.

Where each setting comes from, first found wins: the flag, then the environment, then the default.

    processes per node  --world_size   WORLD_SIZE / nnodes   1
    nodes               --nnodes       -                     the hosts in --hostfile, else 1
    this node's rank    --node_rank    NODE_RANK             0
    node 0's address    --master_addr  MASTER_ADDR           first host of --hostfile; 127.0.0.1 on one node
    node 0's port       --master_port  MASTER_PORT           a free port on one node, 29500 on several

On several nodes run the same command on every node with its own node rank (torchrun, or DeepSpeed with a
rank given: ``--no_ssh``); DeepSpeed without a node rank and mpirun start every host of ``--hostfile`` from
this one. Inconsistent settings are refused before anything starts.

When a rank fails the job stops: torchrun ends the other ranks of its node and exits, and the launcher prints
one line naming the rank and exits non-zero. On the other nodes, ranks waiting for the dead one fail at once
over gloo; a collective over HCCL or NCCL may wait instead, so the launchers of nodes 1 and up check node 0's
rendezvous store and stop their ranks when it has stopped answering for about 20 s. Node 0 cannot tell that
another node went: there the process group's timeout ends the wait on gloo and NCCL (transformers:
``--ddp_timeout``); HCCL groups take none, and on a Gaudi the progress watchdog ends it during training.
SIGINT, SIGTERM and SIGHUP are passed on to the job (unless the launcher was started ignoring them, as nohup
does); its ranks get ``--grace_period`` seconds to finish their step and checkpoint, then are killed; a second
signal kills them at once. Whatever is left of the job when the launcher exits is killed.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..errors import UserError
from ..precision.op_lists import LIST_FILES_ENV

DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's default, used when the nodes must agree on one
DEFAULT_GRACE_PERIOD = 30  # torchrun's own wait between passing SIGTERM on to its workers and killing them

DEEPSPEED_INSTALL = (
    "pip install deepspeed (on Gaudi, Habana's fork: pip install git+https://github.com/HabanaAI/DeepSpeed.git@<release>,"
    " the release that matches your Gaudi software)"
)
MPI_INSTALL = "install Open MPI (e.g. apt-get install openmpi-bin)"
# Forwarded to the other hosts by mpirun and DeepSpeed over ssh (on this host every process inherits the whole
# environment): the bridge's, HCCL's and libfabric's (FI_*, Gaudi scale-out) settings, the Hub's (HF_*: cache,
# offline mode, token) and whether torch autoloads the bridge; not the cards this node makes visible, which
# are each node's own.
_MPI_FORWARDED_PREFIXES = (
    "PT_HPU_", "HABANA_", "HCCL_", "FI_", "HF_", "OPTIMUM_GAUDI_", "TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH",
    "LD_LIBRARY_PATH",
)  # fmt: skip
_PER_NODE = ("HABANA_VISIBLE_MODULES", "HABANA_VISIBLE_DEVICES")


def _forwarded(environ: Mapping[str, str]) -> list[str]:
    return [name for name in sorted(environ) if name.startswith(_MPI_FORWARDED_PREFIXES) and name not in _PER_NODE]


# Run by each process mpirun starts: the Open MPI ranks become the variables torch.distributed and
# transformers read; the op-list files the bridge reads are written where this node lacks them (the launcher
# wrote them on its own node, and with 1.21+ the bridge reads them during `import torch`, before any of our
# code), in this user's private directory and by content, not trusted by name; then the script runs as
# `python SCRIPT ARGS` would run it.
MPI_WORKER = f"""
import json, os, runpy, sys
e = os.environ
for name, ompi in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
                   ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
    if ompi in e:
        e[name] = e[ompi]
if "RANK" in e and "LOCAL_WORLD_SIZE" in e:  # the node's index: ranks fill the nodes in order (ppr:N:node)
    e["GROUP_RANK"] = str(int(e["RANK"]) // int(e["LOCAL_WORLD_SIZE"]))
for path, text in json.loads(e.get("{LIST_FILES_ENV}", "{{}}")).items():
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    info = os.lstat(os.path.dirname(path))
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        sys.exit(f"error: {{os.path.dirname(path)}} is not a directory only you can write; remove it")
    try:
        with open(path) as f:
            current = f.read()
    except OSError:
        current = None
    if current != text:
        with open(f"{{path}}.{{os.getpid()}}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{{path}}.{{os.getpid()}}.tmp", path)
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class LaunchError(UserError, ValueError):
    """Settings that cannot make a job; the message is one line saying what to change."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the launcher decided, before it builds a command line."""

    backend: str  # "torchrun", "deepspeed" or "mpi"
    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    hostfile: str | None = None
    per_node: bool = True  # False: deepspeed / mpirun start every host of the hostfile from this one
    executable: str | None = None  # the deepspeed or mpirun program
    max_restarts: int = 0
    grace_period: int = DEFAULT_GRACE_PERIOD  # seconds the ranks get after a stop signal

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


# ---- settings -----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options; numbers are read as text so that a bad one gets the same one-line error as a bad
    environment variable."""
    parser.add_argument(
        "--world_size",
        "--nproc_per_node",
        dest="world_size",
        metavar="N",
        help="processes on each node, one per card (gaudi_spawn.py's --world_size, torchrun's --nproc_per_node); "
        "default: WORLD_SIZE / nnodes, else 1",
    )
    parser.add_argument("--nnodes", metavar="N", help="number of nodes; default: the hosts in --hostfile, else 1")
    parser.add_argument("--node_rank", metavar="R", help="this node's rank, 0 to nnodes-1; default: NODE_RANK, else 0")
    parser.add_argument(
        "--master_addr",
        metavar="HOST",
        help="address of node 0, the same on every node; default: MASTER_ADDR, else 127.0.0.1 on one node",
    )
    parser.add_argument(
        "--master_port",
        metavar="PORT",
        help=f"port on node 0; default: MASTER_PORT, else a free port on one node, {DEFAULT_MASTER_PORT} on several",
    )
    parser.add_argument(
        "--hostfile",
        metavar="PATH",
        help="with --use_deepspeed or --use_mpi: lines 'HOST slots=N'; the job is started on these hosts from here",
    )
    parser.add_argument("--use_deepspeed", action="store_true", help="start the processes with DeepSpeed's launcher")
    parser.add_argument("--use_mpi", action="store_true", help="start the processes with Open MPI's mpirun")
    parser.add_argument(
        "--max_restarts",
        metavar="N",
        help="torchrun only: when a rank dies, restart the job up to N times; each restart resumes from the newest "
        "complete checkpoint in --output_dir (default 0: a failed rank ends the job)",
    )
    parser.add_argument(
        "--grace_period",
        metavar="SECONDS",
        help=f"after SIGTERM/SIGINT, how long the ranks get to finish their step and checkpoint before they are "
        f"killed (default {DEFAULT_GRACE_PERIOD}); give your scheduler at least this much more",
    )
    parser.add_argument("--dry_run", action="store_true", help="print the command that would run, and exit")
    parser.add_argument("script", metavar="SCRIPT", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="the script's arguments")


def _fail(message: str) -> NoReturn:
    raise LaunchError(message)


def _integer(text: str, name: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        _fail(f"{name} must be a whole number, got {text!r}")
    if value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        _fail(f"{name} must be {bounds}, got {value}")
    return value


def _setting(flag_value: str | None, flag: str, environ: Mapping[str, str], variable: str) -> tuple[str | None, str]:
    """The value and where it came from (for messages): the flag first, then a non-empty environment variable."""
    if flag_value is not None:
        return flag_value, flag
    value = environ.get(variable, "").strip()
    return (value, f"{variable} (environment)") if value else (None, "")


def read_hostfile(path: str) -> list[str]:
    """Host names of a DeepSpeed / Open MPI hostfile: 'HOST slots=N' lines, '#' comments."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        _fail(f"cannot read --hostfile {path}: {e.strerror or e}")
    hosts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if any(not re.fullmatch(r"slots=\d+", word) for word in words[1:]):
            _fail(f"--hostfile {path} line {number}: expected 'HOST slots=N', got {line.strip()!r}")
        if words[0] in hosts:
            _fail(f"--hostfile {path} lists {words[0]} twice (line {number})")
        hosts.append(words[0])
    if not hosts:
        _fail(f"--hostfile {path} lists no host")
    return hosts


def free_port() -> int:
    """A TCP port free right now (torchrun binds it a moment later; a clash is unlikely, and would be reported)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    """Node 0's rendezvous listens on ``port``: fail before starting anything when something already does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store: TIME_WAIT is no clash
        try:
            s.bind(("", port))
        except OSError as e:
            what = "is already in use on this machine" if e.errno == errno.EADDRINUSE else f"cannot be used ({e})"
            _fail(
                f"port {port} {what}; choose another --master_port (or MASTER_PORT), or leave both unset for a free one"
            )


def _deepspeed_executable(environ: Mapping[str, str]) -> str:
    if importlib.util.find_spec("deepspeed") is None:
        _fail(f"--use_deepspeed needs DeepSpeed, which is not installed: {DEEPSPEED_INSTALL}")
    search = os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")])
    executable = shutil.which("deepspeed", path=search)
    if executable is None:
        _fail(
            f"DeepSpeed is importable but its 'deepspeed' launcher is on neither PATH nor {Path(sys.executable).parent}"
        )
    return executable


def _backend(args: argparse.Namespace) -> str:
    """The launcher to start the processes with, chosen before anything else is checked."""
    if args.use_deepspeed and args.use_mpi:
        _fail("--use_deepspeed and --use_mpi exclude each other: choose one launcher")
    backend = "deepspeed" if args.use_deepspeed else "mpi" if args.use_mpi else "torchrun"
    if not Path(args.script).is_file():
        _fail(f"training script not found: {args.script}")
    return backend


def _nodes(args: argparse.Namespace, backend: str) -> tuple[list[str] | None, int]:
    """The hostfile's hosts (None without one) and the number of nodes, which defaults to them."""
    hosts = read_hostfile(args.hostfile) if args.hostfile else None
    if hosts is not None and backend == "torchrun":
        _fail(
            "--hostfile needs --use_deepspeed or --use_mpi; with torchrun run the launcher on each node with --node_rank"
        )
    nnodes = _integer(args.nnodes, "--nnodes", 1) if args.nnodes is not None else len(hosts) if hosts else 1
    if hosts is not None and nnodes > len(hosts):
        _fail(f"--nnodes {nnodes} but --hostfile {args.hostfile} lists {len(hosts)} host(s)")
    return hosts, nnodes


def _node_rank(
    args: argparse.Namespace, env: Mapping[str, str], backend: str, hosts: list[str] | None, nnodes: int
) -> tuple[int, bool]:
    """This node's rank, and whether each node starts its own processes (False: one launcher starts them all)."""
    rank_text, rank_source = _setting(args.node_rank, "--node_rank", env, "NODE_RANK")
    node_rank = _integer(rank_text, rank_source, 0) if rank_text is not None else 0
    if node_rank >= nnodes:
        _fail(f"{rank_source} is {node_rank} but there are {nnodes} node(s): node ranks go from 0 to {nnodes - 1}")
    per_node = backend == "torchrun" or (backend == "deepspeed" and rank_text is not None)
    if nnodes > 1 and backend != "torchrun" and hosts is None:
        _fail(f"--use_{'mpi' if backend == 'mpi' else 'deepspeed'} on {nnodes} nodes needs --hostfile listing them")
    if backend == "mpi" and node_rank > 0:
        _fail(f"mpirun starts every node from the first one: run the launcher there only, without {rank_source}")
    return node_rank, per_node


def _processes_per_node(args: argparse.Namespace, env: Mapping[str, str], nnodes: int) -> int:
    """--world_size, else the environment's WORLD_SIZE (every process of the job) split over the nodes, else 1."""
    total_text = env.get("WORLD_SIZE", "").strip()
    total = _integer(total_text, "WORLD_SIZE (environment)", 1) if total_text else None
    if args.world_size is not None:
        nproc = _integer(args.world_size, "--world_size", 1)
    elif total is not None:
        if total % nnodes:
            _fail(f"WORLD_SIZE={total} (environment) does not split over {nnodes} nodes: give --world_size")
        nproc = total // nnodes
    else:
        nproc = 1
    if total is not None and total != nnodes * nproc:
        _fail(
            f"WORLD_SIZE={total} (environment) but {nnodes} node(s) x {nproc} process(es) = {nnodes * nproc}: "
            "WORLD_SIZE counts every process of the job; correct it or unset it"
        )
    return nproc


def _master_addr(args: argparse.Namespace, env: Mapping[str, str], hosts: list[str] | None, nnodes: int) -> str:
    """Node 0's address: given, else the hostfile's first host, else this machine when it is the only node."""
    addr, _ = _setting(args.master_addr, "--master_addr", env, "MASTER_ADDR")
    if addr is None:
        if hosts is not None:
            addr = hosts[0]
        elif nnodes == 1:
            addr = "127.0.0.1"
        else:
            _fail(
                f"{nnodes} nodes need node 0's address: give --master_addr or set MASTER_ADDR, the same on every node"
            )
    return addr


def _given_port(args: argparse.Namespace, env: Mapping[str, str]) -> int | None:
    """Node 0's port as given by flag or environment; None: the default is chosen once every check has passed."""
    port_text, port_source = _setting(args.master_port, "--master_port", env, "MASTER_PORT")
    return _integer(port_text, port_source, 1, 65535) if port_text is not None else None


def _executable(backend: str, env: Mapping[str, str]) -> str | None:
    """The deepspeed or mpirun program, found before anything starts; None for torchrun (this Python runs it)."""
    executable = None
    if backend == "deepspeed":
        executable = _deepspeed_executable(env)
    elif backend == "mpi":
        executable = shutil.which("mpirun", path=env.get("PATH", os.defpath))
        if executable is None:
            _fail(f"--use_mpi needs 'mpirun' on PATH, which was not found: {MPI_INSTALL}, or drop --use_mpi")
    return executable


def _max_restarts(args: argparse.Namespace, backend: str) -> int:
    """--max_restarts, which only torchrun's elastic agent can honour."""
    max_restarts = _integer(args.max_restarts, "--max_restarts", 0) if args.max_restarts is not None else 0
    if max_restarts and backend != "torchrun":
        _fail(f"--max_restarts needs torchrun's elastic agent: drop --use_{'mpi' if backend == 'mpi' else 'deepspeed'}")
    return max_restarts


def _grace_period(args: argparse.Namespace, backend: str) -> int | None:
    """--grace_period (None: not given), which only a torchrun with --shutdown_timeout can honour."""
    grace = _integer(args.grace_period, "--grace_period", 1) if args.grace_period is not None else None
    if grace is not None and backend != "torchrun":
        _fail("--grace_period is torchrun's stop timeout: deepspeed and mpirun have none to set; drop it")
    if grace not in (None, DEFAULT_GRACE_PERIOD) and not _torchrun_has_shutdown_timeout():
        _fail(
            f"--grace_period {grace}: this torch's torchrun always kills its ranks {DEFAULT_GRACE_PERIOD} s after "
            "a stop signal (it has no --shutdown_timeout); upgrade torch or drop --grace_period"
        )
    return grace


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check the flags against each other and against the environment; raise LaunchError at the first problem."""
    env = os.environ if environ is None else environ
    backend = _backend(args)
    hosts, nnodes = _nodes(args, backend)
    node_rank, per_node = _node_rank(args, env, backend, hosts, nnodes)
    nproc = _processes_per_node(args, env, nnodes)
    addr = _master_addr(args, env, hosts, nnodes)
    port = _given_port(args, env)
    executable = _executable(backend, env)
    max_restarts = _max_restarts(args, backend)
    grace = _grace_period(args, backend)
    if port is None:
        port = free_port() if nnodes == 1 and hosts is None else DEFAULT_MASTER_PORT  # free here, maybe not there
    return LaunchPlan(
        backend=backend,
        script=args.script,
        script_args=tuple(args.script_args),
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        hostfile=args.hostfile,
        per_node=per_node,
        executable=executable,
        max_restarts=max_restarts,
        grace_period=grace or DEFAULT_GRACE_PERIOD,
    )


def _torchrun_has_shutdown_timeout() -> bool:
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:
        return False
    return "shutdown_timeout" in getattr(LaunchConfig, "__dataclass_fields__", {})


# ---- the environment other nodes get -----------------------------------------------------------------------

# DeepSpeed's runner forwards over ssh only variables with a few prefixes (NCCL, PYTHON, ...) and the KEY=VALUE
# lines of a `.deepspeed_env` (named by DS_ENV_FILE), read from the home and the current directory
# (deepspeed/launcher/runner.py): the bridge's variables reach the other nodes only through such a file.
DEEPSPEED_ENV_FILE_VARIABLE = "DS_ENV_FILE"
_DEEPSPEED_USER_FILES = (Path.home() / ".deepspeed_env", Path(".deepspeed_env"))


def deepspeed_env_file(plan: LaunchPlan, environ: Mapping[str, str], directory: str | os.PathLike) -> dict[str, str]:
    """For DeepSpeed over ssh: write a private environment file for the other nodes (the user's own
    `.deepspeed_env` lines first, then the bridge's variables) and return the variable naming it; nothing
    for a job started on each node by itself, whose processes inherit this environment."""
    if plan.backend != "deepspeed" or plan.per_node:
        return {}
    lines = []
    for user_file in _DEEPSPEED_USER_FILES:  # naming our file instead hides these from DeepSpeed: carry them over
        if user_file.is_file():
            lines += [line.rstrip("\n") for line in user_file.read_text().splitlines() if "=" in line]
    lines += [f"{name}={environ[name]}" for name in _forwarded(environ)]
    path = Path(directory) / "deepspeed_env"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{line}\n" for line in lines))
    return {DEEPSPEED_ENV_FILE_VARIABLE: str(path.resolve())}


# ---- command lines ------------------------------------------------------------------------------------------


def build_command(plan: LaunchPlan, python: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The command that starts the whole job on this node (or, for deepspeed over ssh and mpirun, on every node)."""
    python = python or sys.executable
    env = os.environ if environ is None else environ
    n, w, r = str(plan.nnodes), str(plan.nproc_per_node), str(plan.node_rank)
    addr, port = plan.master_addr, str(plan.master_port)
    if plan.backend == "torchrun":
        # torchrun, ending without its traceback (launch/torchrun.py)
        command = [python, "-m", "optimum_gaudi.launch.torchrun", "--nnodes", n, "--nproc_per_node", w]
        if plan.max_restarts:  # a restart needs a new rendezvous round, which the static one cannot hold
            command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:{port}", "--rdzv_id", f"job-{port}"]
            command += ["--max_restarts", str(plan.max_restarts)]
        else:
            command += ["--node_rank", r, "--master_addr", addr, "--master_port", port, "--rdzv_backend", "static"]
            command += ["--max_restarts", "0"]
    elif plan.backend == "deepspeed":
        # --no_local_rank: the script reads LOCAL_RANK from the environment, as under torchrun
        command = [plan.executable or "deepspeed", "--num_nodes", n, "--num_gpus", w]
        command += ["--master_addr", addr, "--master_port", port, "--no_local_rank"]
        if plan.hostfile:
            command += ["--hostfile", plan.hostfile]
        if plan.nnodes > 1 and plan.per_node:
            command += ["--no_ssh", "--node_rank", r]
    elif plan.backend == "mpi":
        command = [plan.executable or "mpirun", "-n", str(plan.world_size)]
        if plan.hostfile:
            command += ["--hostfile", plan.hostfile, "--map-by", f"ppr:{w}:node"]
            command += [x for name in _forwarded(env) for x in ("-x", name)]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")  # Gaudi containers run as root; Open MPI refuses it otherwise
        # no binding: Open MPI would pin each rank to one core, starving its data loader threads
        command += ["--bind-to", "none", "-x", f"MASTER_ADDR={addr}", "-x", f"MASTER_PORT={port}"]
        command += [python, "-u", "-c", MPI_WORKER]
    else:
        raise ValueError(f"unknown backend {plan.backend!r}")
    return [*command, plan.script, *plan.script_args]


# ---- running ------------------------------------------------------------------------------------------------
