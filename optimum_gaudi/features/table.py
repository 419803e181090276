"""The table, logged once per run and printed by `optimum-gaudi env`, of which Gaudi features are on and
what each one does on the device at hand."""

from __future__ import annotations

from typing import Any

from ..devices import FEATURES, Device
from . import linear_cross_entropy


def feature_states(args: Any, gaudi_config: Any) -> dict[str, Any]:
    """Each feature's setting, read from the training arguments or the Gaudi config (None: not known)."""
    states = {}
    for name in FEATURES:
        source = gaudi_config if name.startswith(("use_fused", "use_torch_autocast")) else args
        states[name] = getattr(source, name, None) if source is not None else None
    if args is not None:  # transformers leaves --fsdp None, a string or True
        states["fsdp"] = bool(getattr(args, "fsdp", None))
    if args is not None and gaudi_config is not None:  # the flag or the config key
        states["use_fused_linear_cross_entropy"] = linear_cross_entropy.enabled(args, gaudi_config)
    return states


def feature_table(device: Device, args: Any = None, gaudi_config: Any = None) -> str:
    """A fixed-width table: feature | setting | what it does on `device`."""
    states = feature_states(args, gaudi_config)
    rows = [("feature", "setting", f"on {device.type}")]
    for name in FEATURES:
        state = states[name]
        setting = "-" if state is None else ("on" if state is True else "off" if state is False else str(state))
        rows.append((name, setting, device.behaviour[name]))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    note = _bf16_note(device, args, states["use_torch_autocast"])
    if note is not None:
        lines.append(f"bf16: {note}; for speed here, train in float32 (without --bf16 and use_torch_autocast).")
    return "\n".join(lines)


def _bf16_note(device: Device, args: Any, autocast_config: bool | None) -> str | None:
    """What bf16 costs on the device that autocasts (the host's with --half_precision_backend cpu_amp), where the
    run computes in bf16 and that device only emulates it. A run the user asked for bf16 keeps it: turning it off
    would change the results."""
    if not (autocast_config or getattr(args, "bf16", False)):
        return None
    return getattr(args, "autocast_device", device).bf16_note()
