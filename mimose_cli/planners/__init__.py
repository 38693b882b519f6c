"""Planners by name. Each takes ``(model, budget, *, blocks, safety_margin, meter, **options)``."""

from mimose_cli.planners.base import FullCheckpointing, NoCheckpointing, Planner, StepInfo, infer_input_size
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


__all__ = ["PLANNERS", "Mimose", "Planner", "StepInfo", "build_planner", "infer_input_size"]
