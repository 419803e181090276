"""What the Gaudi bridge must find in the environment of a script that ``optimum-gaudi launch`` starts.

Apart from op_lists.py because it loads the script's Gaudi config: op_lists.py is what the GaudiConfig itself
uses to hand its lists to the bridge (``GaudiConfig.declare_autocast_bf16_fp32_ops``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

from .gaudi_config import GaudiConfig, GaudiConfigError
from .op_lists import LIST_FILES_ENV, config_uses_op_lists, op_list_environment, resolve_op_lists


def launch_environment(script_args: Sequence[str]) -> dict[str, str]:
    """What the bridge must find in the environment of a training script started with `script_args`, set
    before Python starts (Gaudi software 1.21+ loads the bridge during `import torch`): PT_HPU_LAZY_MODE from
    ``--use_lazy_mode``, and the op lists of ``--gaudi_config_name`` when its autocast uses them. Empty when
    no bridge is installed. A config that cannot load is left to the script, which reports it."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return {}
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--gaudi_config_name")
    parser.add_argument("--use_lazy_mode", nargs="?", const="true", default="false")
    known, _ = parser.parse_known_args(list(script_args))
    env = {"PT_HPU_LAZY_MODE": "1" if known.use_lazy_mode.strip().lower() in ("true", "1", "yes", "y", "t") else "0"}
    if known.gaudi_config_name:
        try:
            config = GaudiConfig.from_pretrained(known.gaudi_config_name)
        except GaudiConfigError:
            return env
        if config_uses_op_lists(config):
            lists = op_list_environment(*resolve_op_lists(config.autocast_bf16_ops, config.autocast_fp32_ops))
            env.update(lists)
            env[LIST_FILES_ENV] = json.dumps({path: Path(path).read_text() for path in lists.values()})
    return env
