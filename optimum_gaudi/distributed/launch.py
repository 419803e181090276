"""Run a training script on several processes, cards and nodes: ``optimum-gaudi launch``.

    optimum-gaudi launch --world_size 8 run_clm.py ARGS...                  one server, 8 cards
    optimum-gaudi launch --world_size 8 --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 run_clm.py ARGS...
    optimum-gaudi launch --world_size 8 --use_deepspeed run_clm.py --deepspeed ds_config.json ARGS...
    optimum-gaudi launch --world_size 8 --use_mpi run_clm.py ARGS...

By default the processes are started by torchrun (``python -m torch.distributed.run``, static rendezvous at
MASTER_ADDR:MASTER_PORT, no restarts); ``--use_deepspeed`` starts them with DeepSpeed's ``deepspeed`` launcher
and ``--use_mpi`` with Open MPI's ``mpirun``. Each process gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
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
another node went: there the process group's timeout ends the wait (transformers: ``--ddp_timeout``).
SIGINT, SIGTERM and SIGHUP are passed on to the job (unless the launcher was started ignoring them, as nohup
does); a second one kills it. Whatever is left of the job when the launcher exits is killed.
"""

from __future__ import annotations

import argparse
import codecs
import errno
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..errors import UserError
from ..op_lists import LIST_FILES_ENV

DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's default, used when the nodes must agree on one
STOP_GRACE_SECONDS = 45.0  # after passing on SIGINT/SIGTERM: torchrun gives its workers 30 s, then SIGKILL
MASTER_WATCH_INTERVAL = 5.0  # seconds between two checks that node 0's rendezvous store still answers
MASTER_WATCH_MISSES = 4  # refused checks in a row after which node 0 is taken for gone
_OUTPUT_TAIL_CHARS = 256 * 1024  # the end of the job's stderr kept to find the failed rank in

DEEPSPEED_INSTALL = (
    "pip install deepspeed (on Gaudi, Habana's fork: pip install git+https://github.com/HabanaAI/DeepSpeed.git@<release>,"
    " the release that matches your Gaudi software)"
)
MPI_INSTALL = "install Open MPI (e.g. apt-get install openmpi-bin)"
# Forwarded to the other hosts by mpirun (on this host every process inherits the whole environment).
_MPI_FORWARDED_PREFIXES = ("PT_HPU_", "HABANA_", "HCCL_", "OPTIMUM_GAUDI_", "PYTHONPATH", "LD_LIBRARY_PATH")

# Run by each process mpirun starts: the Open MPI ranks become the variables torch.distributed and
# transformers read; the op-list files the bridge reads are written where this node lacks them (the launcher
# wrote them on its own node, and with 1.21+ the bridge reads them during `import torch`, before any of our
# code); then the script runs as `python SCRIPT ARGS` would run it.
MPI_WORKER = f"""
import json, os, runpy, sys
e = os.environ
for name, ompi in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
                   ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                   ("GROUP_RANK", "OMPI_COMM_WORLD_NODE_RANK")):
    if ompi in e:
        e[name] = e[ompi]
for path, text in json.loads(e.get("{LIST_FILES_ENV}", "{{}}")).items():
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
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


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check the flags against each other and against the environment; raise LaunchError at the first problem."""
    env = os.environ if environ is None else environ
    if args.use_deepspeed and args.use_mpi:
        _fail("--use_deepspeed and --use_mpi exclude each other: choose one launcher")
    backend = "deepspeed" if args.use_deepspeed else "mpi" if args.use_mpi else "torchrun"
    if not Path(args.script).is_file():
        _fail(f"training script not found: {args.script}")

    hosts = read_hostfile(args.hostfile) if args.hostfile else None
    if hosts is not None and backend == "torchrun":
        _fail(
            "--hostfile needs --use_deepspeed or --use_mpi; with torchrun run the launcher on each node with --node_rank"
        )
    nnodes = _integer(args.nnodes, "--nnodes", 1) if args.nnodes is not None else len(hosts) if hosts else 1
    if hosts is not None and nnodes > len(hosts):
        _fail(f"--nnodes {nnodes} but --hostfile {args.hostfile} lists {len(hosts)} host(s)")

    rank_text, rank_source = _setting(args.node_rank, "--node_rank", env, "NODE_RANK")
    node_rank = _integer(rank_text, rank_source, 0) if rank_text is not None else 0
    if node_rank >= nnodes:
        _fail(f"{rank_source} is {node_rank} but there are {nnodes} node(s): node ranks go from 0 to {nnodes - 1}")
    per_node = backend == "torchrun" or (backend == "deepspeed" and rank_text is not None)
    if nnodes > 1 and backend != "torchrun" and hosts is None:
        _fail(f"--use_{'mpi' if backend == 'mpi' else 'deepspeed'} on {nnodes} nodes needs --hostfile listing them")
    if backend == "mpi" and node_rank > 0:
        _fail(f"mpirun starts every node from the first one: run the launcher there only, without {rank_source}")

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
    port_text, port_source = _setting(args.master_port, "--master_port", env, "MASTER_PORT")
    if port_text is not None:
        port = _integer(port_text, port_source, 1, 65535)

    executable = None
    if backend == "deepspeed":
        executable = _deepspeed_executable(env)
    elif backend == "mpi":
        executable = shutil.which("mpirun", path=env.get("PATH", os.defpath))
        if executable is None:
            _fail(f"--use_mpi needs 'mpirun' on PATH, which was not found: {MPI_INSTALL}, or drop --use_mpi")
    if port_text is None:
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
    )


# ---- command lines ------------------------------------------------------------------------------------------


def build_command(plan: LaunchPlan, python: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The command that starts the whole job on this node (or, for deepspeed over ssh and mpirun, on every node)."""
    python = python or sys.executable
    env = os.environ if environ is None else environ
    n, w, r = str(plan.nnodes), str(plan.nproc_per_node), str(plan.node_rank)
    addr, port = plan.master_addr, str(plan.master_port)
    if plan.backend == "torchrun":
        command = [python, "-m", "torch.distributed.run", "--nnodes", n, "--nproc_per_node", w, "--node_rank", r]
        command += ["--master_addr", addr, "--master_port", port, "--rdzv_backend", "static", "--max_restarts", "0"]
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
            command += [x for name in sorted(env) if name.startswith(_MPI_FORWARDED_PREFIXES) for x in ("-x", name)]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-run-as-root")  # Gaudi containers run as root; Open MPI refuses it otherwise
        # no binding: Open MPI would pin each rank to one core, starving its data loader threads
        command += ["--bind-to", "none", "-x", f"MASTER_ADDR={addr}", "-x", f"MASTER_PORT={port}"]
        command += [python, "-u", "-c", MPI_WORKER]
    else:
        raise ValueError(f"unknown backend {plan.backend!r}")
    return [*command, plan.script, *plan.script_args]


# ---- running ------------------------------------------------------------------------------------------------

_PORT_IN_USE = re.compile(r"address already in use|EADDRINUSE|errno: 98\b", re.I)
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):(?P<body>.*?)(?:={20,}|\Z)", re.S)
_TORCHRUN_RANK = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_TORCHRUN_EXITCODE = re.compile(r"\bexitcode\s*:\s*(-?\d+)")
_TORCHRUN_AGENT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_MPI_EXIT = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*Exit code:\s*(-?\d+)")
_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def describe_failure(plan: LaunchPlan, output: str, returncode: int) -> str:
    """One line naming the rank that failed first, read from the launcher's report at the end of ``output``."""
    where = f"node {plan.node_rank}" if plan.per_node or plan.nnodes == 1 else "one of the nodes"
    if _PORT_IN_USE.search(output):  # taken between our check and the rendezvous, or on node 0 of several
        return f"port {plan.master_port} on {plan.master_addr} is already in use; choose another --master_port"
    if plan.backend == "torchrun":
        roots = list(_ROOT_CAUSE.finditer(output))
        if roots:
            body = roots[-1].group("body")
            rank, code = _TORCHRUN_RANK.search(body), _TORCHRUN_EXITCODE.search(body)
            if rank and code:
                return (
                    f"rank {rank.group(1)} (local rank {rank.group(2)} on node {plan.node_rank}) "
                    f"{_how(int(code.group(1)))}; torchrun stopped the other ranks of this node"
                )
        agent = _TORCHRUN_AGENT.findall(output)
        if agent:
            code, local_rank = int(agent[0][0]), int(agent[0][1])
            rank = plan.node_rank * plan.nproc_per_node + local_rank
            return f"rank {rank} (local rank {local_rank} on node {plan.node_rank}) {_how(code)}"
    elif plan.backend == "mpi":
        found = _MPI_EXIT.search(output)
        if found:
            return f"rank {found.group(1)} {_how(int(found.group(2)))}; mpirun stopped the other ranks"
        found = _MPI_SIGNAL.search(output)
        if found:
            return f"rank {found.group(1)} {_how(-int(found.group(2)))}; mpirun stopped the other ranks"
    return f"{plan.backend} exited with code {returncode} on {where}; the failed rank's output is above"


def _exit_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to send SIGTERM to the child if the launcher dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, int(signal.SIGTERM))


class _MasterWatch:
    """From node 1 and up: node 0's torchrun holds the rendezvous store until every node is done (its exit
    barrier), and drops it when its job fails. Connections refused MASTER_WATCH_MISSES times in a row, once node 0
    is known to have been up, mean it is gone, though a collective here (HCCL, NCCL) may wait for it forever."""

    def __init__(self, addr: str, port: int) -> None:
        self.address = (addr, port)
        self.was_up = False
        self.misses = 0
        self._next = 0.0

    def gone(self, workers_started: bool) -> bool:
        """Check, at most every MASTER_WATCH_INTERVAL seconds; ``workers_started``: this node's torchrun got past
        the rendezvous, so node 0 was up even if no check of ours caught it."""
        self.was_up = self.was_up or workers_started
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + MASTER_WATCH_INTERVAL
        try:
            with socket.create_connection(self.address, timeout=3.0):
                pass
        except OSError:
            self.misses += 1
            return self.was_up and self.misses >= MASTER_WATCH_MISSES
        self.was_up, self.misses = True, 0
        return False


class _Job:
    """The launcher's child (torchrun, deepspeed or mpirun) in its own session, its stderr copied through to ours
    with the end kept, its descendants remembered so that none outlives the launcher."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            list(command), env=env, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_exit_with_parent()
        )
        self.signal: int | None = None  # the signal the launcher received and passed on
        self.stop_reason: str | None = None
        self._deadline: float | None = None
        self._tail: deque[str] = deque()
        self._tail_chars = 0
        self._known: dict[int, object] = {}  # pid -> psutil.Process (remembers its start time)
        self._copier = threading.Thread(target=self._copy_stderr, name="launch-stderr", daemon=True)
        self._copier.start()

    def _copy_stderr(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        fd = self.process.stderr.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            text = decoder.decode(chunk)
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone (a closed pipe): keep draining, or the job blocks
                pass
            self._tail.append(text)
            self._tail_chars += len(text)
            while self._tail_chars > _OUTPUT_TAIL_CHARS and len(self._tail) > 1:
                self._tail_chars -= len(self._tail.popleft())

    @property
    def output_tail(self) -> str:
        return "".join(self._tail)

    def _remember_descendants(self) -> None:
        try:
            import psutil  # installed with accelerate
        except ImportError:
            return
        try:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                self._known.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def _signal_group(self, signum: int) -> None:
        if self.process.returncode is not None:  # reaped: its group id may belong to someone else by now
            return
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, signum: int, reason: str | None = None) -> None:
        """Pass a stop signal on (torchrun forwards it to its workers); a second request kills everything."""
        if self._deadline is not None:
            self.kill_everything()
            return
        self.stop_reason = reason
        self._deadline = time.monotonic() + STOP_GRACE_SECONDS
        self._signal_group(signum)

    def kill_everything(self) -> None:
        self._remember_descendants()
        self._signal_group(signal.SIGKILL)
        for process in list(self._known.values()):
            try:
                if process.is_running():  # psutil: False if the pid now belongs to another process
                    try:
                        os.killpg(process.pid, signal.SIGKILL)  # the worker's own session (torchrun starts them so)
                    except OSError:
                        pass
                    process.kill()
            except Exception:
                pass

    def on_signal(self, signum: int, frame) -> None:
        self.signal = self.signal or signum
        self.stop(signum, f"received {signal.Signals(signum).name}")

    def _exited(self) -> bool:
        """Whether the child has exited, without reaping it: until it is reaped its pid and process group id
        cannot be given to another process, so cleaning up its group cannot hit a stranger."""
        if not hasattr(os, "waitid"):
            return self.process.poll() is not None
        try:
            return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def wait(self, watch: _MasterWatch | None = None) -> int:
        while not self._exited():
            time.sleep(0.5)
            self._remember_descendants()
            if self._deadline is not None and time.monotonic() > self._deadline:
                self.kill_everything()
            elif self._deadline is None and watch is not None and watch.gone(workers_started=bool(self._known)):
                host, port = watch.address
                self.stop(
                    signal.SIGTERM, f"node 0 ({host}:{port}) stopped answering, so this node's ranks were stopped"
                )
        self.kill_everything()  # leftovers: workers torchrun could not reap, their own children
        returncode = self.process.wait()
        self._copier.join(timeout=5)
        return returncode


def run(plan: LaunchPlan, command: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end; return its exit code (128 + signal number when the launcher was signalled)."""
    print(f"optimum-gaudi launch: {shlex.join(command)}", file=sys.stderr, flush=True)
    in_main_thread = threading.current_thread() is threading.main_thread()
    forwarded = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {}
    job = _Job(command, env)
    try:
        if in_main_thread:
            wanted = [signum for signum in forwarded if signal.getsignal(signum) is not signal.SIG_IGN]
            previous = {signum: signal.signal(signum, job.on_signal) for signum in wanted}
        watch = None
        if plan.backend == "torchrun" and plan.nnodes > 1 and plan.node_rank > 0:
            watch = _MasterWatch(plan.master_addr, plan.master_port)
        returncode = job.wait(watch)
    finally:
        job.kill_everything()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if job.signal is not None:
        print(f"error: {job.stop_reason}; the job was stopped", file=sys.stderr, flush=True)
        return 128 + job.signal
    if job.stop_reason is not None:
        print(f"error: {job.stop_reason}", file=sys.stderr, flush=True)
        return returncode or 1
    if returncode != 0:
        print(f"error: {describe_failure(plan, job.output_tail, returncode)}", file=sys.stderr, flush=True)
        return returncode if returncode > 0 else 128 - returncode
    return 0


def launch(args: argparse.Namespace) -> int:
    """``optimum-gaudi launch``: raise LaunchError for settings that cannot work, else run the job."""
    from ..op_lists import launch_environment

    plan = resolve(args)
    bridge_env = launch_environment(plan.script_args)  # read by the Gaudi bridge when it loads, before our code
    command = build_command(plan, environ={**os.environ, **bridge_env})  # mpirun forwards them to other nodes
    if args.dry_run:
        print(shlex.join([*(f"{k}={v}" for k, v in bridge_env.items()), *command]))
        return 0
    if plan.nnodes == 1 or (plan.node_rank == 0 and plan.per_node):  # node 0 runs here: the port must be free
        check_port_free(plan.master_port)
    if bridge_env:
        print(f"optimum-gaudi launch: {' '.join(f'{k}={v}' for k, v in bridge_env.items())}", file=sys.stderr)
    return run(plan, command, {**os.environ, **bridge_env})
