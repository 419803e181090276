"""A stalled rank at default settings, and what the watchdog and the straggler figures cost (issue 38).

recovery   optimum-gaudi launch --max_restarts 1, steps of about 1 s (a 1 s pause per step stands in for
           compute), default --hang_timeout (so 60 s, its floor): rank 1 stops (SIGSTOP from here), spins in an
           endless loop, or waits in a collective never joined (within a step: only the collectives issued tell
           it from the others), after checkpoint-5; timed from the stall to the first step the restarted job
           ends. "reload" is the restart's share: from the hang report to the restarted job's train begin (new
           processes, imports, the model and checkpoint loaded). On gloo (CPU processes) and on simulated Gaudis
           (hccl without a timeout, sequence numbers or a flight record, as the bridge: tests/fakes).
drill      issue 46's at the scale users run: 8 processes on simulated Gaudis, a tiny Llama: one rank stopped,
           one in a collective never joined (each reported and resumed: recovery rows), one whose step 2 (a step
           that may compile) lasts 5 x the 60 s floor: it must end with no verdict (false fires).
counting   the project's collective count (supervision/collective_count.py, on where the backend keeps none):
           what it adds to one collective, in process on a gloo group of one, against a step.
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


def _gaudis(processes: int) -> dict[str, str]:
    """The environment of a job on simulated Gaudis (the test double in tests/fakes)."""
    fakes = str(ROOT / "tests" / "fakes")
    return {"PYTHONPATH": os.pathsep.join([fakes, str(ROOT)]), "FAKE_HPU_DEVICE": "1",
            "FAKE_HPU_DEVICE_COUNT": str(processes), "STALL_MODEL": "llama"}  # fmt: skip


def _launch(
    processes: int, out: Path, mode: str, *flags: str, restarts: int = 0, env=None, gaudis: bool = False
) -> subprocess.Popen:
    command = [sys.executable, "-m", "optimum_gaudi", "launch", "--world_size", str(processes)]
    command += ["--max_restarts", str(restarts)] if restarts else []
    command += [WORKER, str(out), mode, "--output_dir", str(out / "run"), *FLAGS, *flags]
    command += ["--use_habana"] if gaudis else []
    env = {**_env(), **(_gaudis(processes) if gaudis else {}), **(env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def recovery(processes: int, mode: str, timeout: float = 900, gaudis: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        job = _launch(processes, out, mode, "--max_steps", "10", "--save_strategy", "steps", "--save_steps", "5",
                      restarts=1, gaudis=gaudis)  # fmt: skip
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
            verdict = (reports[0] / "summary.txt").read_text().strip()
            began = next(b["time"] for b in _lines(out / "begins.jsonl") if b["attempt"] == 1)
            job.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if job.poll() is None:
                job.kill()
    total = resumed - stalled
    return {
        "verdict": verdict,
        "to_report": reported - stalled,
        "reload": began - reported,
        "first_step": resumed - began,
        "total": total,
        "total_less_reload": total - (began - reported),
    }


def false_fires(processes: int, seconds: float = 5 * 60, timeout: float = 1800) -> dict:
    """A run on simulated Gaudis whose rank 1 spends ``seconds`` in step 2 (a step that may compile), at default
    settings: whether the watchdog fired (it must not), and the run's wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        began = time.monotonic()
        job = _launch(processes, out, "compile", "--max_steps", "5", "--save_strategy", "no", gaudis=True,
                      env={"COMPILE_SECONDS": str(seconds)})  # fmt: skip
        _, err = job.communicate(timeout=timeout)
        fired = sorted((out / "run").glob("hang-*"))
        return {"fired": len(fired), "returncode": job.returncode, "seconds": time.monotonic() - began,
                "compile_seconds": seconds, "error": err[-2000:] if job.returncode else ""}  # fmt: skip


def counting_cost(repeats: int = 2000) -> dict:
    """Microseconds one collective costs more with the project's count on (an all-reduce of one float on a gloo
    group of one process, so the collective itself is as cheap as it gets), interleaved."""
    import torch
    import torch.distributed as dist

    from optimum_gaudi.supervision import collective_count

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            x = torch.ones(1)
            plain, counted = [], []
            asks = collective_count.backend_counts
            for _ in range(5):
                for times, on in ((plain, False), (counted, True)):
                    if on:
                        collective_count.backend_counts = lambda group=None: False  # as on HCCL
                        collective_count.start()
                    began = time.perf_counter()
                    for _ in range(repeats):
                        dist.all_reduce(x)
                    times.append((time.perf_counter() - began) / repeats * 1e6)
                    collective_count.stop()
        finally:
            collective_count.backend_counts = asks
            dist.destroy_process_group()
    return {"plain_us": median(plain), "counted_us": median(counted)}


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


KINDS = [  # (mode, processes, on simulated Gaudis)
    ("stop", 2, False), ("stop", 4, False), ("loop", 2, False), ("collective", 2, False), ("stop", 8, False),
    ("collective", 8, False), ("stop", 2, True), ("collective", 2, True), ("stop", 4, True), ("collective", 4, True),
    ("stop", 8, True), ("collective", 8, True),
]  # fmt: skip


def recoveries(kinds: list[tuple[str, int, bool]], m: dict) -> str:
    rows = []
    for mode, processes, gaudis in kinds:
        r = recovery(processes, mode, gaudis=gaudis)
        m[f"{mode}_{processes}" + ("_hccl" if gaudis else "")] = r
        where = "simulated Gaudis (hccl)" if gaudis else "gloo"
        rows.append([f"{mode}, {processes} processes, {where}"] + [f"{r[k]:.0f} s" for k in (
            "to_report", "reload", "first_step", "total", "total_less_reload")] + [r["verdict"].split(" (")[0]])  # fmt: skip
    return markdown_table(
        ["stall", "stall to report", "reload", "first step", "stall to resumed", "less the reload", "verdict"], rows
    )


def drill_text(m: dict, processes: int = 8) -> str:
    m["false_fires"] = f = false_fires(processes)
    return markdown_table(
        [f"{processes} processes on simulated Gaudis, a tiny Llama", "watchdog verdicts", "run"],
        [[f"rank 1's step 2 (may compile) lasts {f['compile_seconds']:.0f} s, 5 x the floor", str(f["fired"]),
          f"{f['seconds']:.0f} s, exit {f['returncode']}"]],
    )  # fmt: skip


def counting_text(m: dict) -> str:
    m["counting"] = c = counting_cost()
    return markdown_table(
        ["the project's collective count (on HCCL only)", "one all-reduce, 1 process"],
        [["without", f"{c['plain_us']:.1f} us"], ["counted", f"{c['counted_us']:.1f} us"]],
    )


def run(quick: bool = False) -> tuple[str, dict]:
    m: dict = {}
    text = recoveries(KINDS if not quick else [("stop", 2, False)], m)
    if not quick:
        text += "\n\n" + drill_text(m)
    text += "\n\n" + counting_text(m)
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


if __name__ == "__main__":  # one part alone: python -m benchmarks.stalls drill | counting | MODE,PROCESSES,hccl|gloo
    results: dict = {}
    for part in sys.argv[1:]:
        if part == "drill":
            print(drill_text(results), flush=True)
        elif part == "counting":
            print(counting_text(results), flush=True)
        else:
            mode, processes, backend = part.split(",")
            print(recoveries([(mode, int(processes), backend == "hccl")], results), flush=True)
    print(json.dumps(results, indent=1, default=str))
