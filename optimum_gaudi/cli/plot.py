"""One PNG of a training run, from the ``trainer_state.json`` that Trainer writes.

Panels against the optimizer step: loss (and eval loss), learning rate, throughput (``*_per_second``) and
memory (``memory_allocated (GB)``, ``max_memory_allocated (GB)``). matplotlib is optional and imported only
here; the figure is drawn straight onto an Agg canvas, so plotting never changes the caller's pyplot backend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CommandError

__all__ = ["PlotError", "find_trainer_state", "plot_run"]

STATE_FILE = "trainer_state.json"
MEMORY_KEYS = ("memory_allocated (GB)", "max_memory_allocated (GB)")
TOTAL_MEMORY_KEY = "total_memory_available (GB)"
_RATE_UNITS = ("samples", "tokens", "steps")  # the first one a group has is the one drawn
_HEADROOM = 1.3  # y range above the highest value, so the legend has room and top markers are not clipped

History = list[dict[str, Any]]


class PlotError(RuntimeError):
    """A run could not be plotted; the message is one line saying why and what to do."""


# ---- reading the run --------------------------------------------------------------------------------------


def find_trainer_state(output_dir: str | os.PathLike) -> Path:
    """``output_dir/trainer_state.json``, else the one in the checkpoint with the highest step."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise PlotError(f"{output_dir} is not a directory; pass the --output_dir of a training run.")
    top = output_dir / STATE_FILE
    if top.is_file():
        return top
    checkpoints = []
    for path in output_dir.glob(f"checkpoint-*/{STATE_FILE}"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.parent.name)
        if match:
            checkpoints.append((int(match.group(1)), path))
    if not checkpoints:
        raise PlotError(
            f"no {STATE_FILE} in {output_dir} or its checkpoint-* folders; "
            "save a checkpoint (--save_strategy steps/epoch) or call trainer.save_state() after training."
        )
    return max(checkpoints)[1]


def _load(state_file: Path) -> tuple[dict[str, Any], History]:
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PlotError(f"cannot read {state_file}: {e}") from e
    history = [e for e in state.get("log_history", []) if isinstance(e, dict) and isinstance(e.get("step"), int)]
    if not history:
        raise PlotError(f"{state_file} has no logged steps; train with --logging_strategy steps --logging_steps N.")
    return state, history


def _series(history: History, key: str) -> tuple[list[int], list[float]]:
    points = [(e["step"], e[key]) for e in history if isinstance(e.get(key), (int, float)) and math.isfinite(e[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _rate_groups(history: History) -> dict[str, dict[str, str]]:
    """``*_per_second`` keys by what they time: {"train": {"samples": "train_samples_per_second", ...}, ...}.

    A group gets one line (samples/s, else tokens/s, else steps/s): its other rates say the same thing at
    another scale, so they are quoted in the label rather than squashing the axis.
    """
    groups: dict[str, dict[str, str]] = {}
    for key in sorted({k for e in history for k in e if k.endswith("_per_second")}):
        prefix, _, unit = key.removesuffix("_per_second").rpartition("_")
        if unit not in _RATE_UNITS:
            prefix, unit = key.removesuffix("_per_second"), "items"
        groups.setdefault(prefix or "run", {})[unit] = key
    return groups


# ---- drawing ----------------------------------------------------------------------------------------------


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "matplotlib":
            raise PlotError(
                "plotting needs matplotlib, which is not installed: pip install matplotlib (or optimum-gaudi[plot])"
            ) from e
        raise
    return Figure, FigureCanvasAgg


def _line(ax, steps: list[int], values: list[float], label: str, **style) -> None:
    marker = "o" if len(steps) <= 40 else ""
    ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.4, label=label, **style)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _finish(ax, ylabel: str, from_zero: bool = False) -> None:
    ax.set_ylabel(ylabel)
    if from_zero:
        top = max((max(line.get_ydata(), default=0) for line in ax.lines), default=0)
        ax.set_ylim(0, top * _HEADROOM if top > 0 else 1)
    ax.legend(fontsize="small", loc="best")


def _draw_loss(ax, history: History) -> None:
    ax.set_title("Loss")
    drawn = False
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        steps, values = _series(history, key)
        if steps:
            _line(ax, steps, values, label)
            drawn = True
    _finish(ax, "loss") if drawn else _note(ax, "no loss in the log history")


def _draw_learning_rate(ax, history: History) -> None:
    ax.set_title("Learning rate")
    steps, values = _series(history, "learning_rate")
    if not steps:
        _note(ax, "no learning_rate in the log history")
        return
    _line(ax, steps, values, "learning rate")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))


def _draw_throughput(ax, history: History, last_step: int) -> None:
    """Rates logged along the way as lines; a rate logged once (an end-of-run summary) as a dashed level over
    the steps it was measured on (from ``<prefix>_throughput_warmup_steps`` when the run logged it)."""
    ax.set_title("Throughput")
    for prefix, keys in _rate_groups(history).items():
        unit = next(u for u in (*_RATE_UNITS, "items") if u in keys)
        steps, values = _series(history, keys[unit])
        if len(steps) > 1:
            _line(ax, steps, values, f"{prefix} {unit}/s")
        elif steps:
            first = next((e[k] for e in history if (k := f"{prefix}_throughput_warmup_steps") in e), 0)
            quoted = [  # steps/s is samples/s over the batch size: not worth quoting next to samples/s
                f"{_series(history, key)[1][-1]:,.4g} {u}/s"
                for u, key in keys.items()
                if u not in (unit, "steps") and _series(history, key)[1]
            ]
            label = f"{prefix} {unit}/s, run average {values[0]:,.4g}" + (f" ({', '.join(quoted)})" if quoted else "")
            ax.plot([first, last_step], [values[0]] * 2, linestyle="--", linewidth=1.8, label=label)
    if ax.lines:
        _finish(ax, "per second", from_zero=True)
    else:
        _note(ax, "no *_per_second values in the log history:\nthroughput panel skipped")


def _draw_memory(ax, history: History) -> None:
    totals = _series(history, TOTAL_MEMORY_KEY)[1]
    ax.set_title("Memory" + (f" (of {totals[-1]:g} GB available)" if totals else ""))
    for key in MEMORY_KEYS:
        steps, values = _series(history, key)
        if steps:
            _line(ax, steps, values, key.removesuffix(" (GB)").replace("_", " "))
    if ax.lines:
        _finish(ax, "GB", from_zero=True)
    else:
        hint = "(train with --log_throughput_and_memory)"
        _note(ax, f"no memory_allocated (GB) values in the log history\n{hint}: memory panel skipped")


def plot_run(output_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> Path:
    """Write a PNG of the run in ``output_dir`` (default ``output_dir/training_plot.png``) and return its path.

    Raises PlotError (one line) when there is nothing to plot or matplotlib is missing.
    """
    output_dir = Path(output_dir)
    state_file = find_trainer_state(output_dir)
    state, history = _load(state_file)
    Figure, FigureCanvasAgg = _matplotlib()
    out = Path(out_path) if out_path is not None else output_dir / "training_plot.png"

    last_step = max(max(e["step"] for e in history), state.get("global_step") or 0, 1)
    fig = Figure(figsize=(12, 8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    (loss_ax, lr_ax), (speed_ax, memory_ax) = fig.subplots(2, 2)
    _draw_loss(loss_ax, history)
    _draw_learning_rate(lr_ax, history)
    _draw_throughput(speed_ax, history, last_step)
    _draw_memory(memory_ax, history)
    for ax in (loss_ax, lr_ax, speed_ax, memory_ax):
        if ax.lines:
            ax.set_xlabel("optimizer step")
            ax.set_xlim(0, last_step * 1.02)
            ax.grid(True, alpha=0.3)

    epoch = state.get("epoch")
    epoch_text = f", epoch {epoch:.2f}" if isinstance(epoch, (int, float)) and math.isfinite(epoch) else ""
    source = state_file.relative_to(output_dir)
    fig.suptitle(f"{output_dir.resolve().name}: {last_step} steps{epoch_text}  (from {source})")

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e}") from e
    return out


# ---- the command ------------------------------------------------------------------------------------------


def _run_plot(args: argparse.Namespace) -> int:
    try:
        path = plot_run(args.output_dir, args.out)
    except PlotError as e:
        raise CommandError(str(e)) from e
    print(path)
    return 0


def add_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw loss, learning rate, throughput and memory of a run to a PNG",
        description="Reads OUTPUT_DIR/trainer_state.json (or the newest checkpoint's) and writes a PNG.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the --output_dir of a training run")
    parser.add_argument("--out", metavar="PATH", help="where to write the PNG (default: OUTPUT_DIR/training_plot.png)")
    parser.set_defaults(run=_run_plot)
