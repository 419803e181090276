"""Will it fit, and how fast: per-card memory and rough speed of training a model with each candidate setting,
before the first run (`optimum-gaudi plan`). Arithmetic only: imports no torch and no trainer code."""

from .check import PlanDoesNotFit, check_run, run_setting
from .hardware import CARDS, Card, card
from .memory import Breakdown, breakdown
from .model import ModelShape, load_model_shape, shape_from_config
from .planner import Candidate, Plan, candidate_settings, command_line, plan
from .report import format_plan
from .settings import Assumption, Assumptions, Setting, Workload

__all__ = [
    "CARDS", "PlanDoesNotFit", "check_run", "run_setting", "Assumption", "Assumptions", "Breakdown", "Candidate", "Card", "ModelShape", "Plan", "Setting",
    "Workload", "breakdown", "candidate_settings", "card", "command_line", "format_plan", "load_model_shape", "plan",
    "shape_from_config",
]  # fmt: skip
