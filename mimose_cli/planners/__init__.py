"""Planners by name. Each takes ``(model, budget, *, blocks, safety_margin, meter, **options)``."""

from mimose_cli.planners.base import (Decision, FullCheckpointing, NoCheckpointing, Planner, StepInfo,
                                     infer_input_size)
from mimose_cli.planners.blocks import BlockRunner, PlanRunner, discover_blocks
from mimose_cli.planners.dtr import DTR
from mimose_cli.planners.mimose import Mimose
from mimose_cli.planners.oracle import Oracle
from mimose_cli.planners.sublinear import Sublinear

PLANNERS = {
    "mimose": Mimose,
    "none": NoCheckpointing,
    "full": FullCheckpointing,
    "sublinear": Sublinear,
    "dtr": DTR,
    "oracle": Oracle,
}


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """Build a planner by name; unknown names raise ValueError listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return PLANNERS[name](model, budget, **kwargs)


__all__ = ["PLANNERS", "BlockRunner", "DTR", "Decision", "FullCheckpointing", "Mimose", "NoCheckpointing",
           "Oracle", "PlanRunner", "Planner", "StepInfo", "Sublinear", "build_planner", "discover_blocks",
           "infer_input_size"]
