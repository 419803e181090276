"""Model preparation: the stages a trainer runs on its model, in one written order (pipeline.py)."""

from .pipeline import STAGES, ModelPreparation

__all__ = ["STAGES", "ModelPreparation"]
