"""What the Gaudi bridge must find in the environment of a script that ``optimum-gaudi launch`` starts.

The launcher's, not configuration/'s: it reads the script's command line and loads the Gaudi config it names,
then hands the op lists over with precision/op_lists.py (what the GaudiConfig itself uses,
``GaudiConfig.declare_autocast_bf16_fp32_ops``). Loads without torch, as the launcher does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..configuration.gaudi_config import GaudiConfig, GaudiConfigError
from ..precision.op_lists import LIST_FILES_ENV, config_uses_op_lists, op_list_environment, resolve_op_lists

LAZY_MODE_ENV = "PT_HPU_LAZY_MODE"
_TRUE = ("true", "1", "yes", "y", "t")


def script_gaudi_arguments(script_args: Sequence[str]) -> tuple[bool | None, str | None]:
    """``use_lazy_mode`` and ``gaudi_config_name`` as a script started with ``script_args`` will read them: its
    flags, or a single JSON arguments file (scripts call ``HfArgumentParser.parse_json_file`` when given one
    ``.json`` argument). None for a setting they leave out; a file that cannot be read is left to the script."""
    if len(script_args) == 1 and script_args[0].endswith(".json"):
        try:
            values = json.loads(Path(script_args[0]).read_text())
        except (OSError, ValueError):
            return None, None
        if not isinstance(values, dict):
            return None, None
        lazy, name = values.get("use_lazy_mode"), values.get("gaudi_config_name")
    else:
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        parser.add_argument("--gaudi_config_name")
        parser.add_argument("--use_lazy_mode", nargs="?", const="true")
        known, _ = parser.parse_known_args(list(script_args))
        lazy, name = known.use_lazy_mode, known.gaudi_config_name
    if lazy is not None and not isinstance(lazy, bool):
        lazy = str(lazy).strip().lower() in _TRUE
    return lazy, name if isinstance(name, str) and name else None


def launch_environment(script_args: Sequence[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """What the bridge must find in the environment of a training script started with `script_args`, set
    before Python starts (Gaudi software 1.21+ loads the bridge during `import torch`): PT_HPU_LAZY_MODE from
    ``use_lazy_mode`` (a flag, or a JSON arguments file), and the op lists of ``gaudi_config_name`` when its
    autocast uses them. Empty when no bridge is installed. A config that cannot load is left to the script,
    which reports it. Raises ValueError when an exported PT_HPU_LAZY_MODE contradicts the arguments."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return {}
    environ = os.environ if environ is None else environ
    lazy, config_name = script_gaudi_arguments(script_args)
    env: dict[str, str] = {}
    exported = environ.get(LAZY_MODE_ENV)
    if exported is not None:
        # The user's own value stays: the bridge reads it as lazy unless "0" (``utils/internal.py``). One that
        # contradicts the arguments would only fail later, in every process.
        if lazy is not None and (exported != "0") != lazy:
            mode = "lazy" if exported != "0" else "eager"
            raise ValueError(
                f"{LAZY_MODE_ENV}={exported} is exported ({mode} mode) but the script's arguments set use_lazy_mode "
                f"to {lazy}: unset {LAZY_MODE_ENV}, or make it and the arguments agree."
            )
    elif lazy is not None:
        env[LAZY_MODE_ENV] = "1" if lazy else "0"
    # Neither exported nor in the arguments (code may set use_lazy_mode, or parse its arguments otherwise): left
    # unset, not forced to "0". Unset, Gaudi software 1.21+ loads the bridge in eager mode during `import torch`,
    # as "0" would; 1.18-1.20 do not load it until the script's own training arguments have set the mode, where
    # "0" would have turned autoload on and loaded it in eager mode before any code of the script ran.
    if config_name:
        try:
            config = GaudiConfig.from_pretrained(config_name)
        except GaudiConfigError:
            return env
        if config_uses_op_lists(config):
            # names unchecked: the script checks them, and here that would import torch (on 1.21+, the bridge too)
            resolved = resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops, check_names=False)
            lists = op_list_environment(*resolved)
            env.update(lists)
            env[LIST_FILES_ENV] = json.dumps({path: Path(path).read_text() for path in lists.values()})
    return env
