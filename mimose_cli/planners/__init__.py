"""Planners by name. Each takes ``(model, budget, *, blocks, safety_margin, meter, **options)``."""

from mimose_cli.planners.base import FullCheckpointing, NoCheckpointing, Planner, StepInfo, infer_input_size

PLANNERS = {
    "none": NoCheckpointing,
    "full": FullCheckpointing,
}


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """Build a planner by name; unknown names raise ValueError listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return PLANNERS[name](model, budget, **kwargs)


__all__ = ["PLANNERS", "Planner", "StepInfo", "build_planner", "infer_input_size"]
