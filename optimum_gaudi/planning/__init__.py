"""Will it fit, and how fast: per-card memory and rough speed of training a model with each candidate setting,
before the first run (`optimum-gaudi plan`). Arithmetic only: imports no torch and no trainer code."""

from .check import PlanDoesNotFit, check_run, run_setting
from .hardware import CARDS, Card, card
from .memory import Breakdown, adapter_parameters, breakdown
from .model import ModelShape, load_model_shape, shape_from_config
from .planner import Candidate, Plan, candidate_settings, command_line, plan
from .report import format_plan
from .settings import Adapters, Assumption, Assumptions, Setting, Workload

__all__ = [
    "CARDS", "PlanDoesNotFit", "check_run", "run_setting", "Adapters", "Assumption", "Assumptions", "Breakdown", "Candidate", "Card", "ModelShape", "Plan", "Setting",
    "Workload", "adapter_parameters", "breakdown", "candidate_settings", "card", "command_line", "format_plan", "load_model_shape", "plan",
    "shape_from_config",
]  # fmt: skip
