"""A run for benchmarks/stalls.py, under ``optimum-gaudi launch``.

    stall_worker.py OUT_DIR MODE [GaudiTrainingArguments flags...]

MODE ``stop``, ``loop`` or ``collective``: a tiny GPT-2 (``STALL_MODEL=llama``: a tiny Llama) whose steps take
about 1 s (a 1 s pause per step stands in for compute; this CPU is shared). Rank 0 appends each step's end to
OUT_DIR/steps.jsonl (attempt, step, time) and each attempt's train begin to OUT_DIR/begins.jsonl; rank 1 writes
its pid to OUT_DIR/pid.rank1. In the first attempt, at the end of step STALL_STEP (7), rank 1 spins in an endless
loop (``loop``); in step STALL_STEP + 1's forward it all-reduces on a group of every rank (the run's backend: hccl
on simulated Gaudis) that the others never join (``collective``: every rank is in the same step, only the
collectives issued tell them apart), after writing the time to OUT_DIR/stalled; for ``stop`` the benchmark sends
it SIGSTOP. MODE ``compile``: in step 2 (a step that may compile on a Gaudi) rank 1's forward sleeps
``COMPILE_SECONDS`` (a compile longer than the watchdog's floor); no stall: the run must end without a verdict.
MODE ``speed`` / ``speed-off``: no pause, no stall; rank 0 writes OUT_DIR/speed.json (after warm-up: seconds a
step, from its begin to its end; seconds from one step's end to the next, every callback and log included; whether
the project's collective count ran); ``speed-off`` runs without the watchdog and the straggler figures
(``speed`` with ``--hang_timeout 0``: without the watchdog only). MODE ``watchdog-ab``: trainings with the
watchdog on and off alternating in the same processes (AB_ROUNDS pairs); rank 0 writes OUT_DIR/ab.json. MODE ``agreement``: no
training; each rank times the per-step cost of SIGTERM's agreement, then and now, into OUT_DIR/agreement.rankN.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tiny.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from optimum_gaudi.supervision import collective_count  # noqa: E402

STALL_STEP = 7


class Record(TrainerCallback):
    def __init__(self, out: Path, mode: str, restart: int) -> None:
        self.out, self.mode, self.restart = out, mode, restart
        self.never_joined = None
        self.began: float | None = None
        self.step = 0
        self.times: list[float] = []
        self.ends: list[float] = []  # perf_counter at each step's end (before the watchdog's own step end)
        self.cpu_ends: list[float] = []  # this process's CPU time (every thread's) at each step's end
        self.counted = False  # the project's collective count ran (supervision/collective_count.py)

    def _append(self, name: str, record: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self.never_joined = dist.new_group()  # the default backend: hccl on simulated Gaudis
        if args.process_index == 0:
            self._append("begins.jsonl", {"attempt": self.restart, "time": time.time()})
        if args.process_index == 1:
            (self.out / "pid.rank1").write_text(str(os.getpid()))

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.mode.startswith("speed"):
            time.sleep(1.0)
        self.step = state.global_step + 1
        self.began = time.perf_counter()

    def forward_hook(self, rank: int, device: torch.device):
        def hook(module, inputs):
            if self.restart or rank != 1:
                return
            if self.mode == "compile" and self.step == 2:
                time.sleep(float(os.environ.get("COMPILE_SECONDS", "300")))
            if self.mode == "collective" and self.step == STALL_STEP + 1:
                (self.out / "stalled").write_text(str(time.time()))
                dist.all_reduce(torch.ones(1, device=device), group=self.never_joined)

        return hook

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.began)
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.counted = self.counted or collective_count.active() is not None
        if args.process_index == 0:
            self._append("steps.jsonl", {"attempt": self.restart, "step": state.global_step, "time": time.time()})
        if self.restart or state.global_step != STALL_STEP or args.process_index != 1:
            return
        if self.mode == "loop":
            (self.out / "stalled").write_text(str(time.time()))
            while True:
                pass


def agreement(out: Path, repeats: int = 300) -> None:
    """Per step, what each rank paid to agree on SIGTERM: before, an all-reduce over a gloo group of every rank;
    now, one look at the job's store (supervision/agreement.py)."""
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    store = dist.distributed_c10d._get_default_store()
    flag = torch.zeros(1)
    for _ in range(20):  # warm both paths up
        dist.all_reduce(flag, group=group)
        store.check(["optimum_gaudi/stop/bench"])
    dist.barrier()
    began = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    all_reduce = (time.perf_counter() - began) / repeats
    dist.barrier()
    began = time.perf_counter()
    for _ in range(repeats):
        store.check(["optimum_gaudi/stop/bench"])
    check = (time.perf_counter() - began) / repeats
    result = {"all_reduce_us": all_reduce * 1e6, "store_check_us": check * 1e6}
    (out / f"agreement.rank{dist.get_rank()}").write_text(json.dumps(result))
    dist.destroy_process_group()


def _model(record: Record, args) -> torch.nn.Module:
    import tiny

    if os.environ.get("STALL_MODEL") == "llama":
        model = tiny.llama()
    else:
        model = tiny.gpt2(**tiny.NO_DROPOUT, n_layer=4, n_embd=128)
    model.register_forward_pre_hook(record.forward_hook(args.process_index, args.device))
    return model


def watchdog_on_and_off(out: Path, args, trainer_class, rounds: int, warmup: int = 5) -> None:
    """``rounds`` pairs of trainings in these processes, one with the watchdog at its defaults and one with
    ``--hang_timeout 0``, their order swapped from round to round; each a new trainer and model (a fresh DDP module:
    the counting hook stays on a module it was once given). Rank 0 writes OUT_DIR/ab.json: each training's median
    interval between step ends after ``warmup`` steps, in wall time and in this process's CPU time (every
    thread's: the watchdog's own included), by arm, and whether the count ran."""
    import tiny

    figures: dict[str, list[float]] = {"on": [], "off": [], "on_cpu": [], "off_cpu": []}
    counted = False
    for round_ in range(rounds):
        for arm in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            args.hang_timeout = None if arm == "on" else 0
            record = Record(out, "speed", 0)
            trainer = trainer_class(model=_model(record, args), args=args, train_dataset=tiny.lm_data(512),
                                    callbacks=[record])  # fmt: skip
            trainer.train()
            for key, ends in ((arm, record.ends), (f"{arm}_cpu", record.cpu_ends)):
                steps = sorted(b - a for a, b in itertools.pairwise(ends[warmup:]))
                figures[key].append(steps[len(steps) // 2])
            counted = counted or (arm == "on" and record.counted)
            del trainer
    if args.process_index == 0:
        (out / "ab.json").write_text(json.dumps({**figures, "counted": counted}))


def main() -> None:
    out, mode, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if mode == "agreement":
        agreement(out)
        os._exit(0)
    import tiny

    import optimum_gaudi.supervision.run as supervision
    from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments

    if mode == "speed-off":  # the same run without the watchdog and the straggler figures
        supervision.watchdog_wanted = lambda args: False
        supervision.Stragglers = lambda *arguments: None
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(argv)
    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mode == "watchdog-ab":
        watchdog_on_and_off(out, args, GaudiTrainer, int(os.environ.get("AB_ROUNDS", "4")))
        tiny.leave_process()
    record = Record(out, mode, restart)
    trainer = GaudiTrainer(model=_model(record, args), args=args, train_dataset=tiny.lm_data(512), callbacks=[record])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if mode.startswith("speed") and args.process_index == 0:
        steady = sorted(record.times[10:])
        intervals = sorted(b - a for a, b in itertools.pairwise(record.ends[10:]))
        (out / "speed.json").write_text(json.dumps({
            "median_step_s": steady[len(steady) // 2], "median_interval_s": intervals[len(intervals) // 2],
            "counted": record.counted,
        }))  # fmt: skip
    tiny.leave_process()


if __name__ == "__main__":
    main()
