"""Running a launch plan: start the job, pass signals on, watch node 0, and name the rank that failed.

The plan itself (settings, checks, the command line) is made in ``plan.py``.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from ..errors import EXIT_USER_ERROR, LAUNCH_USER_ERROR_ENV
from .plan import (
    DEFAULT_GRACE_PERIOD,
    LaunchError,
    LaunchPlan,
    build_command,
    check_port_free,
    deepspeed_env_file,
    resolve,
)
from .ranks import STALL_EXIT_CODE, STALL_LINE_ENV, enable_flight_recorder
from .torchrun import REPORT_ENV

STOP_MARGIN_SECONDS = 15.0  # after passing on SIGINT/SIGTERM we wait the ranks' grace period and this, then kill
MASTER_WATCH_INTERVAL = 5.0  # seconds between two checks that node 0's rendezvous store still answers
MASTER_WATCH_MISSES = 4  # refused checks in a row after which node 0 is taken for gone
_OUTPUT_TAIL_CHARS = 256 * 1024  # the end of the job's stderr kept to find the failed rank in


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


def describe_failure(plan: LaunchPlan, output: str, returncode: int, report: dict | None = None) -> str:
    """One line naming the rank that failed first: from torchrun's ``report`` (launch/torchrun.py), else read
    from the launcher's own report at the end of ``output``."""
    where = f"node {plan.node_rank}" if plan.per_node or plan.nnodes == 1 else "one of the nodes"
    if _PORT_IN_USE.search(output):  # taken between our check and the rendezvous, or on node 0 of several
        return f"port {plan.master_port} on {plan.master_addr} is already in use; choose another --master_port"
    restarts = f" (after {plan.max_restarts} restart(s))" if plan.max_restarts else ""
    if plan.backend == "torchrun" and report:
        return (
            f"rank {report['rank']} (local rank {report['local_rank']} on node {plan.node_rank}) "
            f"{_how(int(report['exitcode']))}{restarts}; torchrun stopped the other ranks of this node"
        )
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

    def __init__(
        self, command: Sequence[str], env: Mapping[str, str] | None = None, grace: float = DEFAULT_GRACE_PERIOD
    ) -> None:
        self.grace = grace + STOP_MARGIN_SECONDS
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
        self._deadline = time.monotonic() + self.grace
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


def _read_report(path: str | None) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, TypeError, ValueError):
        return None


def _read_user_error(path: str | None) -> str | None:
    """The line a rank left for the launcher when it ended on a user error (errors.call_main), if one did."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, TypeError, ValueError):
        return None


def run(plan: LaunchPlan, command: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Run the job to its end; return its exit code (128 + signal number when the launcher was signalled)."""
    print(f"optimum-gaudi launch: {shlex.join(command)}", file=sys.stderr, flush=True)
    in_main_thread = threading.current_thread() is threading.main_thread()
    forwarded = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {}
    job = _Job(command, env, grace=plan.grace_period)
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
    user_error = _read_user_error((env or {}).get(LAUNCH_USER_ERROR_ENV)) if returncode != 0 else None
    if user_error is not None:  # a bad flag, a missing file: the line the script alone prints, once
        print(f"error: {user_error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if returncode != 0:
        report = _read_report((env or {}).get(REPORT_ENV))
        if report and report.get("preempted"):
            print(
                "error: every rank stopped on SIGTERM after writing its checkpoint; resume with "
                "--resume_from_checkpoint true",
                file=sys.stderr,
                flush=True,
            )
            return returncode
        stall = _read_user_error((env or {}).get(STALL_LINE_ENV))  # the progress watchdog's line, if it fired
        if stall is not None and (report is None or report.get("exitcode") == STALL_EXIT_CODE):
            restarts = f" (after {plan.max_restarts} restart(s))" if plan.max_restarts else ""
            print(f"error: {stall}{restarts}", file=sys.stderr, flush=True)
            return returncode
        print(f"error: {describe_failure(plan, job.output_tail, returncode, report)}", file=sys.stderr, flush=True)
        return returncode if returncode > 0 else 128 - returncode
    return 0


def _warn_about_quotes_kept(script_args: Sequence[str]) -> None:
    """gaudi_spawn.py joins the script's arguments into a command that bash reads again, so optimum-habana's READMEs
    quote some values twice (--source_prefix '"summarize: "'); passed on as given, those quotes reach the script."""
    quoted = next((word for word in script_args if len(word) > 1 and word[0] == word[-1] and word[0] in "\"'"), None)
    if quoted is not None:
        print(
            f"optimum-gaudi launch: warning: the script argument {quoted} keeps its quotes: arguments are passed on as "
            "your shell gave them (gaudi_spawn.py had bash read them again); quote once to drop them.",
            file=sys.stderr,
        )


def launch(args: argparse.Namespace) -> int:
    """``optimum-gaudi launch``: raise LaunchError for settings that cannot work, else run the job."""
    from .environment import launch_environment

    plan = resolve(args)
    _warn_about_quotes_kept(plan.script_args)
    try:
        bridge_env = launch_environment(plan.script_args)  # read by the Gaudi bridge when it loads, before our code
    except ValueError as e:  # an exported PT_HPU_LAZY_MODE against the script's arguments
        raise LaunchError(str(e)) from e
    command = build_command(plan, environ={**os.environ, **bridge_env})  # mpirun forwards them to other nodes
    if args.dry_run:
        print(shlex.join([*(f"{k}={v}" for k, v in bridge_env.items()), *command]))
        return 0
    if plan.nnodes == 1 or (plan.node_rank == 0 and plan.per_node):  # node 0 runs here: the port must be free
        check_port_free(plan.master_port)
    if bridge_env:
        print(f"optimum-gaudi launch: {' '.join(f'{k}={v}' for k, v in bridge_env.items())}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="optimum-gaudi-launch-") as private:
        env = {**os.environ, **bridge_env, REPORT_ENV: os.path.join(private, "failure.json")}
        env[LAUNCH_USER_ERROR_ENV] = os.path.join(private, "user_error.txt")
        env[STALL_LINE_ENV] = os.path.join(
            private, "stall.txt"
        )  # the progress watchdog's line (supervision/watchdog.py)
        enable_flight_recorder(env)  # its report names the collective each rank waits in
        if plan.backend == "torchrun":  # how long torchrun waits for its ranks after a stop signal
            env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(plan.grace_period)
            if plan.nproc_per_node > 1:  # what torchrun sets for each rank, without its four-line banner
                env.setdefault("OMP_NUM_THREADS", "1")
        if plan.max_restarts:
            # A new store for each rendezvous round: in the store the agent shares with its workers, the
            # process group's keys from the failed attempt stay behind and the restarted ranks read them
            # (seen here: connections to the dead ranks' ports, or a hang), torch/distributed/rendezvous.py
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update(deepspeed_env_file(plan, env, private))  # DeepSpeed over ssh: the other nodes' environment
        return run(plan, command, env)
