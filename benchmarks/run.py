"""`make bench`: run the benchmarks in one process, print the tables, write docs/benchmarks.md.

Each section is one side-by-side run. `BENCH_SECTIONS=compile make bench` reruns only the named sections
(comma-separated: speed, compile, llama, fused_loss, distributed, fsdp, fsdp_cpu_time, plan, allreduce, context_parallel,
gpu, sharded_save, stalls, watchdog) and replaces just those in docs/benchmarks.md,
each section saying when and under what load it was measured.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import (  # noqa: E402
    allreduce_model,
    compile_speed,
    context_parallel,
    distributed,
    fsdp_cpu_time,
    fsdp_memory,
    fused_loss,
    gpu,
    llama_speed,
    plan_accuracy,
    sharded_save,
    stalls,
    train_speed,
    watchdog_cost,
)
from benchmarks.common import markdown_table  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Made by `make bench` on: {machine}, {cpus} CPUs, torch {torch}, {threads} torch threads. Each section
below is one run of `benchmarks/run.py`; ratios compare variants measured side by side in that run
(interleaved, each run in its own process, medians of repeats), and each section states its date and the
machine's load average.
Throughput excludes warm-up steps.
"""

LOSS_TOLERANCE = 0.01  # bf16 may change the eval loss after the same steps by at most this much


class Targets:
    """The issues' targets, each checked against this run's medians."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def check(self, name: str, value: float, goal: float, fmt: str = "{:.2f}x", at_most: bool = False) -> None:
        met = value <= goal if at_most else value >= goal
        bound = "<=" if at_most else ">="
        self.rows.append([name, f"{bound} {fmt.format(goal)}", fmt.format(value), "met" if met else "**missed**"])

    def table(self) -> str:
        return markdown_table(["target", "goal", "this run", ""], self.rows)


def speed_section(quick: bool) -> str:
    repeats, steps, warmup = (1, 8, 2) if quick else (3, 30, 5)
    text, medians = train_speed.run(repeats=repeats, steps=steps, warmup=warmup)
    t = Targets()
    for model, m in medians.items():
        gaudi, fp32, bf16 = m["gaudi_gpt2"], m["trainer_fp32"], m["trainer_bf16"]
        t.check(f"{model}: GaudiTrainer / default Trainer, tokens/s", gaudi[0] / fp32[0], 1.6)
        t.check(f"{model}: GaudiTrainer / hand-tuned Trainer (--bf16, fused AdamW)", gaudi[0] / bf16[0], 1.0)
        t.check(
            f"{model}: eval loss, GaudiTrainer bf16 - fp32", abs(gaudi[1] - fp32[1]), LOSS_TOLERANCE, "{:.4f}", True
        )
    return f"## Training speed on this CPU\n\n{t.table()}\n\n{text}"


def compile_section(quick: bool) -> str:
    if quick:
        text, m = compile_speed.run(repeats=1, steps=6, warmup=2, deep_repeats=1, deep_steps=4)
    else:
        text, m = compile_speed.run()
    small, deep = m["small"], m["deep"]
    t = Targets()
    gc, tc, tuned = small["gaudi_compile"][0], small["hand_tuned_compile"][0], small["hand_tuned"][0]
    t.check("GaudiTrainer + compile / hand-tuned + compile (aim 1.2x)", gc / tc, 1.0)
    t.check("GaudiTrainer + compile / hand-tuned without compile", gc / tuned, 1.3)
    t.check("GaudiTrainer without compile / hand-tuned", small["gaudi"][0] / tuned, 1.0)
    whole, regional = deep["gaudi_compile"], deep["gaudi_regional"]
    t.check("12 layers: regional / whole-model compile time", regional[1] / whole[1], 0.5, at_most=True)
    t.check("12 layers: regional / whole-model steady speed", regional[0] / whole[0], 0.95)
    t.check("small model: regional / whole-model steady speed", small["gaudi_regional"][0] / gc, 0.95)
    # bf16 against fp32 with the same dropout masks: GaudiTrainer's compiled code on CPU draws eager's
    # (fallback_random); a plain Trainer's compiled code draws others (trainer_fp32_compile shows how far)
    for setup, reference in (("gaudi", "trainer_fp32"), ("gaudi_compile", "trainer_fp32")):
        diff = abs(small[setup][2] - small[reference][2])
        t.check(f"eval loss, {setup} (bf16) - {reference}", diff, LOSS_TOLERANCE, "{:.4f}", True)
    return f"## torch.compile, op-list autocast and regional compilation\n\n{t.table()}\n\n{text}"


def llama_section(quick: bool) -> str:
    text, m = llama_speed.run(repeats=1, steps=5, warmup=2, tiny=True) if quick else llama_speed.run()
    t = Targets()
    tuned, tuned_compile = m["trainer_bf16"], m["trainer_bf16_compile"]
    gaudi, gaudi_compile = m["gaudi_llama"], m["gaudi_llama_compile"]
    t.check("GaudiTrainer / hand-tuned Trainer, steps/s", gaudi[0] / tuned[0], 1.0)
    t.check("GaudiTrainer + compile / hand-tuned Trainer + compile, steps/s", gaudi_compile[0] / tuned_compile[0], 1.1)
    t.check("GaudiTrainer + compile: share of the bf16 peak", gaudi_compile[0] * m["flops"] / m["peak"], 0.35, "{:.0%}")
    for setup, reference in (("gaudi_llama", "trainer_bf16"), ("gaudi_llama_compile", "trainer_bf16_compile")):
        diff = abs(m[setup][1] - m[reference][1])
        t.check(f"train loss, {setup} - {reference} (both bf16)", diff, LOSS_TOLERANCE, "{:.4f}", True)
    return f"## A Llama-shaped model (SmolLM-135M widths)\n\n{t.table()}\n\n{text}"


def fused_loss_section(quick: bool) -> str:
    text, m = (
        fused_loss.run(repeats=1, steps=4, warmup=2, tiny=True)
        if quick
        else fused_loss.run(repeats=1, steps=3, warmup=1)
    )
    (full_sps, full_rss, full_cpu, full_steady) = m["full_logits"]
    (fused_sps, fused_rss, _, _) = m["fused_eager"]
    (full_c_sps, full_c_rss, full_c_cpu, full_c_steady) = m["full_logits_compiled"]
    (fused_c_sps, fused_c_rss, fused_c_cpu, fused_c_steady) = m["fused_compiled"]
    t = Targets()
    t.check("fused, compiled / full logits, compiled: steps/s", fused_c_sps / full_c_sps, 1.0)
    t.check("fused, compiled / full logits, compiled: steps per CPU-second", full_c_cpu / fused_c_cpu, 1.0)
    t.check("fused, compiled / full logits, compiled: peak RSS", fused_c_rss / full_c_rss, 0.5, at_most=True)
    t.check("fused, compiled / full logits, compiled: timed steps' peak RSS", fused_c_steady / full_c_steady, 0.5,
            at_most=True)  # fmt: skip
    t.check("fused, compiled / full logits, eager: steps per CPU-second", full_cpu / fused_c_cpu, 1.0)
    t.check("fused, compiled / full logits, eager: timed steps' peak RSS", fused_c_steady / full_steady, 0.5,
            at_most=True)  # fmt: skip
    t.check("fused, compiled / full logits, eager: steps/s", fused_c_sps / full_sps, 1.0)
    t.check("fused, compiled / fused, eager: steps/s", fused_c_sps / fused_sps, 1.0)
    t.check("fused, eager / full logits, eager: peak RSS", fused_rss / full_rss, 0.6, at_most=True)
    t.check("fused, eager / full logits, eager: steps/s", fused_sps / full_sps, 1.0)
    t.check("losses at the same step, largest relative difference (fp32)", m["loss_diff"], 1e-4, "{:.1e}", True)
    return f"## Fused linear cross-entropy on a 128k vocabulary\n\n{t.table()}\n\n{text}"


def distributed_section(quick: bool) -> str:
    repeats, steps, warmup = (1, 8, 2) if quick else (3, 30, 5)
    text, d = distributed.run(repeats=repeats, steps=steps, warmup=warmup)
    t = Targets()
    t.check("fast_ddp / ddp, steps/s on 2 processes", d["fast_ddp_2procs"] / d["ddp_2procs"], 1.1)
    t.check("2-process scaling (ddp / 1 process, 2 threads)", d["ddp_2procs"] / d["single_2threads"], 0.95)
    t.check("2-process scaling (fast_ddp / 1 process)", d["fast_ddp_2procs"] / d["single_2threads"], 0.95)
    t.check(
        "DDP with a Gaudi's settings / transformers' settings", d["ddp_gaudi_settings_2procs"] / d["ddp_2procs"], 1.0
    )
    return f"## Distributed: fast_ddp and DDP on 2 CPU processes\n\n{t.table()}\n\n{text}"


def sharded_save_section(quick: bool) -> str:
    text, m = sharded_save.run(repeats=1 if quick else 2)
    t = Targets()
    growth = {setup: m[setup]["rank0_peak_growth"] for setup in m}
    t.check("final save, streamed / gathered: rank 0 memory", growth["final_streamed"] / growth["final_gathered"], 0.6,
            at_most=True)  # fmt: skip
    t.check("final save, streamed / gathered: time", m["final_streamed"]["seconds"] / m["final_gathered"]["seconds"],
            1.5, at_most=True)  # fmt: skip
    t.check("checkpoint, sharded / full: rank 0 memory", growth["checkpoint_sharded"] / growth["checkpoint_full"], 0.5,
            at_most=True)  # fmt: skip
    t.check("checkpoint, sharded / full: time", m["checkpoint_sharded"]["seconds"] / m["checkpoint_full"]["seconds"],
            1.0, at_most=True)  # fmt: skip
    return f"## Saving an FSDP2 model: sharded checkpoints, streamed final weights\n\n{t.table()}\n\n{text}"


def fsdp_section(quick: bool) -> str:
    text, m = fsdp_memory.run(steps=2, warmup=1) if quick else fsdp_memory.run()
    t = Targets()
    for procs, goal in ((2, 0.6), (4, 0.35)):
        fsdp, ddp = m[f"fsdp_{procs}procs"], m[f"ddp_{procs}procs"]
        t.check(f"FSDP / DDP on {procs} processes, peak RSS per rank above baseline", fsdp["above_baseline"] / ddp["above_baseline"], goal, at_most=True)  # fmt: skip
        t.check(f"FSDP / DDP on {procs} processes, peak RSS per rank", fsdp["peak"] / ddp["peak"], goal, at_most=True)
    return f"## FSDP against DDP: memory per rank on 2 and 4 CPU processes\n\n{t.table()}\n\n{text}"


def fsdp_cpu_time_section(quick: bool) -> str:
    chosen_setup = f"gaudi_trainer_{fsdp_cpu_time.host_memory_threshold_mib()}MiB"
    if quick:
        text, m = fsdp_cpu_time.run(steps=4, warmup=2, repeats=1, setups=["hand_written_fsdp2", chosen_setup])
    else:
        text, m = fsdp_cpu_time.run(steps=6, warmup=2, repeats=1)
    hand, chosen = m["hand_written_fsdp2"], m[chosen_setup]
    t = Targets()
    t.check("GaudiTrainer (its threshold) / hand-written FSDP2: CPU s/step", chosen["cpu_per_step"] / hand["cpu_per_step"],
            1.1, at_most=True)  # fmt: skip
    t.check("GaudiTrainer (its threshold) / hand-written FSDP2: peak RSS", chosen["peak"] / hand["peak"], 0.75,
            at_most=True)  # fmt: skip
    return f"## FSDP2 on CPU: CPU time and memory against a hand-written loop, by malloc threshold\n\n{t.table()}\n\n{text}"


def plan_section(quick: bool) -> str:
    names = ("llama", "gpt2") if quick else tuple(plan_accuracy.SETTINGS)
    text, results = plan_accuracy.run(names)
    t = Targets()
    for name, (predicted, measured) in results.items():
        t.check(f"{name}: predicted peak off the measured one by", abs(predicted / measured - 1), 0.15, "{:.0%}",
                at_most=True)  # fmt: skip
    command = "Command: `BENCH_SECTIONS=plan make bench` (benchmarks/plan_accuracy.py says what is measured)."
    return f"## Will it fit? The planner's memory against measured runs\n\n{t.table()}\n\n{text}\n\n{command}"


def allreduce_section(quick: bool) -> str:
    return f"## All-reduce at scale: an alpha-beta estimate\n\n{allreduce_model.run()}"


def context_parallel_section(quick: bool) -> str:
    text, m = context_parallel.run(cap_mb=700 if quick else 1200)
    t = Targets()
    t.check("longest sequence within the cap: 2 processes splitting it / 1 process", m["two"] / max(m["one"], 1), 1.8)
    return f"## Long sequences: --context_parallel_size 2 under a memory cap\n\n{t.table()}\n\n{text}"


def stalls_section(quick: bool) -> str:
    text, m = stalls.run(quick)
    t = Targets()
    for name, r in m.items():
        if isinstance(r, dict) and "total_less_reload" in r:
            mode, processes, *hccl = name.split("_")
            where = "simulated hccl" if hccl else "gloo"
            t.check(f"{mode}, {processes} processes, {where}: stall to resumed, less the reload (s)",
                    r["total_less_reload"], 120, "{:.0f}", at_most=True)  # fmt: skip
    if "false_fires" in m:
        t.check(
            "8 simulated Gaudis, a compile of 5 x the floor: verdicts", m["false_fires"]["fired"], 0, "{:.0f}", True
        )
    overhead = m["overhead"]["on"] / m["overhead"]["off"] - 1
    t.check("watchdog + straggler figures: step time added, 4 processes", 100 * overhead, 1.0, "{:.1f}%", True)
    t.check("SIGTERM agreement now / before, per step", m["agreement"]["store_check_us"] / m["agreement"]["all_reduce_us"],
            1.0, at_most=True)  # fmt: skip
    command = "Command: `BENCH_SECTIONS=stalls make bench` (benchmarks/stalls.py says what each row measures)."
    return f"## A stalled rank: found, reported, restarted (default settings)\n\n{t.table()}\n\n{text}\n\n{command}"


def watchdog_section(quick: bool) -> str:
    rounds, steps = (2, 20) if quick else (6, 60)
    text, runs = watchdog_cost.run(rounds, steps)
    t = Targets()
    for name, r in runs.items():
        what = "watchdog + collective count" if r["counted"] else "watchdog"
        for clock, label in (("_cpu", "CPU"), ("", "wall")):
            t.check(f"{what}, {name}: {label} time added a step", 100 * r[f"cost{clock}"], 1.0, "{:+.2f}%", True)
    command = (
        f"Measured on {watchdog_cost.machine()}, torch {torch.__version__}, one thread a process. Command: `BENCH_SECTIONS=watchdog make "
        "bench` (benchmarks/watchdog_cost.py says what is measured; `python -m benchmarks.watchdog_cost` alone)."
    )
    return f"## The watchdog's cost per step, on and off side by side\n\n{t.table()}\n\n{text}\n\n{command}"


def gpu_section(quick: bool) -> str:
    """Only where a GPU is lent (BENCH_SECTIONS=gpu): the default sections run on the CPU."""
    tiny = quick or os.environ.get("BENCH_GPU_TINY") == "1"
    text, r = gpu.run(tiny=tiny, json_path=os.environ.get("BENCH_GPU_JSON"))
    t = Targets()
    measured, peak, per_token = r["setups"], r["peak"], r["flops_per_token"]
    base = measured.get(gpu.BASELINE, {})
    compiled, flce = measured.get("gaudi_compile", {}), measured.get("gaudi_compile_fp8_flce", {})
    if "tokens_per_s" in base and "tokens_per_s" in compiled:
        t.check(
            "GaudiTrainer + compile / hand-tuned + compile, tokens/s",
            compiled["tokens_per_s"] / base["tokens_per_s"],
            1.0,
        )
        t.check("GaudiTrainer + compile: MFU", compiled["tokens_per_s"] * per_token / peak, 0.55, "{:.0%}")
    if "tokens_per_s" in base and "tokens_per_s" in flce:
        t.check(
            "+ fp8 + fused linear cross-entropy / hand-tuned + compile, tokens/s",
            flce["tokens_per_s"] / base["tokens_per_s"],
            1.3,
        )
        if base["peak_memory_gb"] and flce["peak_memory_gb"]:
            t.check(
                "+ fp8 + fused linear cross-entropy / hand-tuned + compile, peak memory",
                flce["peak_memory_gb"] / base["peak_memory_gb"],
                0.6,
                at_most=True,
            )
    liger = measured.get(gpu.LIGER, {})
    if "tokens_per_s" in liger and "tokens_per_s" in flce:
        t.check("+ fp8 + fused linear cross-entropy / Liger + compile, tokens/s",
                flce["tokens_per_s"] / liger["tokens_per_s"], 1.1)  # fmt: skip
        if liger["peak_memory_gb"] and flce["peak_memory_gb"]:
            t.check("+ fp8 + fused linear cross-entropy / Liger + compile, peak memory",
                    flce["peak_memory_gb"] / liger["peak_memory_gb"], 1.0, at_most=True)  # fmt: skip
    return f"## GPU: a 1B-class Llama, GaudiTrainer against a hand-tuned Trainer\n\n{t.table()}\n\n{text}"


SECTIONS = {
    "speed": speed_section,
    "compile": compile_section,
    "llama": llama_section,
    "fused_loss": fused_loss_section,
    "distributed": distributed_section,
    "fsdp": fsdp_section,
    "fsdp_cpu_time": fsdp_cpu_time_section,  # about 10 minutes on 2 cores: not a default section
    "plan": plan_section,
    "allreduce": allreduce_section,
    "context_parallel": context_parallel_section,
    "gpu": gpu_section,
    "sharded_save": sharded_save_section,  # about 5 minutes on 2 cores: not a default section
    "stalls": stalls_section,  # about an hour (12 stalls of a minute, restarts, the 5-minute compile drill): opt-in
    "watchdog": watchdog_section,  # a few minutes on 2 shared cores (2 launches of 12 trainings)
}
DEFAULT_SECTIONS = (
    "speed",
    "compile",
    "llama",
    "distributed",
    "fsdp",
    "allreduce",
    "context_parallel",
    "plan",
    "watchdog",
)  # gpu: only where one is lent


def _sections_of(text: str) -> dict[str, str]:
    """The '## ' sections of an existing benchmarks.md, by heading, in order."""
    parts = re.split(r"(?m)^(?=## )", text)
    return {part.splitlines()[0]: part.rstrip() + "\n" for part in parts[1:]}


def main() -> None:
    threads = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    quick = os.environ.get("BENCH_QUICK") == "1"  # a smoke run of the benchmark code, not for the docs
    wanted = os.environ.get("BENCH_SECTIONS", ",".join(DEFAULT_SECTIONS)).split(",")
    unknown = [name for name in wanted if name not in SECTIONS]
    if unknown:
        sys.exit(f"BENCH_SECTIONS: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}.")
    results = {}
    for name in wanted:
        start, load = time.time(), os.getloadavg()[0]
        print(f"== {name}", flush=True)
        body = SECTIONS[name](quick).rstrip()
        stamp = (
            f"\n\nMeasured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))} in {time.time() - start:.0f} s;"
            f" load average at the start {load:.1f} on {os.cpu_count()} CPUs.\n"
        )
        results[body.splitlines()[0]] = body + stamp
    header = HEADER.format(
        machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
        threads=threads,
    )  # fmt: skip
    if quick:
        print("\n\n".join(results.values()))
        return
    sections = _sections_of(DOC.read_text()) if DOC.is_file() and len(wanted) < len(SECTIONS) else {}
    sections.update(results)
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(header + "\n" + "\n".join(sections.values()))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
