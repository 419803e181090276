"""A stalled rank at default settings, and what the watchdog and the straggler figures cost (issue 38).

recovery   optimum-gaudi launch --max_restarts 1, steps of about 1 s (a 1 s pause per step stands in for
           compute), default --hang_timeout (so 60 s, its floor): rank 1 stops (SIGSTOP from here), spins in an
           endless loop, or waits in a collective never joined, after checkpoint-5; timed from the stall to the
           first step the restarted job ends. "reload" is the restart's share: from the hang report to the
           restarted job's train begin (new processes, imports, the model and checkpoint loaded).
overhead   4 processes, a 4-layer GPT-2 without pauses, --logging_steps 1 (the straggler gather at every step):
           median step time with the watchdog and straggler figures, and without (interleaved runs).
agreement  8 processes: SIGTERM's agreement per step, before (an all-reduce over gloo) and now (one look at the
           job's store).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, median

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "stall_worker.py")
FLAGS = [
    "--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1",
    "--seed", "0",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(processes: int, out: Path, mode: str, *flags: str, restarts: int = 0, env=None) -> subprocess.Popen:
    command = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(processes)]
    command += ["--max_restarts", str(restarts)] if restarts else []
    command += [WORKER, str(out), mode, "--output_dir", str(out / "run"), *FLAGS, *flags]
    env = {**_env(), **(env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def recovery(processes: int, mode: str, timeout: float = 600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        job = _launch(processes, out, mode, "--max_steps", "9", "--save_strategy", "steps", "--save_steps", "5",
                      restarts=1)  # fmt: skip
        deadline = time.monotonic() + timeout
        stalled = None
        try:
            while time.monotonic() < deadline and job.poll() is None:
                steps = _lines(out / "steps.jsonl")
                if stalled is None and mode == "stop" and any(s["step"] >= 7 for s in steps):
                    os.kill(int((out / "pid.rank1").read_text()), signal.SIGSTOP)
                    stalled = time.time()
                if any(s["attempt"] == 1 for s in steps):
                    break
                time.sleep(0.05)
            stalled = stalled or float((out / "stalled").read_text())
            resumed = next(s["time"] for s in _lines(out / "steps.jsonl") if s["attempt"] == 1)
            reports = sorted((out / "run").glob("hang-*"))
            reported = max(p.stat().st_mtime for p in reports[0].iterdir())
            began = next(b["time"] for b in _lines(out / "begins.jsonl") if b["attempt"] == 1)
            job.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if job.poll() is None:
                job.kill()
    total = resumed - stalled
    return {
        "to_report": reported - stalled,
        "reload": began - reported,
        "first_step": resumed - began,
        "total": total,
        "total_less_reload": total - (began - reported),
    }


def speed(processes: int, mode: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        # without: torch's flight recorder off too (the launcher turns it on for the hang report)
        env = {"TORCH_FR_BUFFER_SIZE": "0"} if mode == "speed-off" else {}
        job = _launch(processes, out, mode, "--max_steps", str(steps), "--save_strategy", "no", env=env)
        _, err = job.communicate(timeout=1800)
        if job.returncode != 0:
            raise RuntimeError(f"{mode} failed:\n{err[-3000:]}")
        return json.loads((out / "speed.json").read_text())["median_step_s"]


def agreement(processes: int = 8) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        command = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(processes), WORKER, tmp]
        done = subprocess.run([*command, "agreement"], env=_env(), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"agreement failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("agreement.rank*"))]
    return {key: median([r[key] for r in ranks]) for key in ("all_reduce_us", "store_check_us")}


def run(quick: bool = False) -> tuple[str, dict]:
    m: dict = {}
    rows = []
    kinds = [("stop", 2), ("stop", 4), ("loop", 2), ("collective", 2)] if not quick else [("stop", 2)]
    for mode, processes in kinds:
        r = recovery(processes, mode)
        m[f"{mode}_{processes}"] = r
        rows.append([f"{mode}, {processes} processes"] + [f"{r[k]:.0f} s" for k in (
            "to_report", "reload", "first_step", "total", "total_less_reload")])  # fmt: skip
    text = markdown_table(
        ["stall", "stall to report", "reload", "first step", "stall to resumed", "less the reload"], rows
    )
    steps, repeats = (30, 1) if quick else (80, 3)
    on, off = [], []
    for _ in range(repeats):  # interleaved
        on.append(speed(4, "speed", steps))
        off.append(speed(4, "speed-off", steps))
    m["overhead"] = {"on": median(on), "off": median(off)}
    text += "\n\n" + markdown_table(
        ["4 processes, --logging_steps 1", "median step", "runs"],
        [
            ["watchdog + straggler figures", f"{m['overhead']['on'] * 1000:.1f} ms", ", ".join(f"{x * 1000:.1f}" for x in on)],
            ["without", f"{m['overhead']['off'] * 1000:.1f} ms", ", ".join(f"{x * 1000:.1f}" for x in off)],
        ],
    )  # fmt: skip
    agreeing = 8 if not quick else 2
    m["agreement"] = agreement(agreeing)
    text += "\n\n" + markdown_table(
        [f"SIGTERM's agreement, per step and rank, {agreeing} processes", "time"],
        [
            ["before: all-reduce over a gloo group of every rank", f"{m['agreement']['all_reduce_us']:.0f} us"],
            ["now: one look at the job's store", f"{m['agreement']['store_check_us']:.0f} us"],
        ],
    )
    return text, m
