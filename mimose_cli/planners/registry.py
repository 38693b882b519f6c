"""Planners by name. Each takes ``(model, budget, *, blocks, safety_margin, meter, **options)``,
``options`` being the fields of its ``planners.options`` dataclass."""

from mimose_cli.planners.base import FullCheckpointing, NoCheckpointing, Planner
from mimose_cli.planners.dtr import DTR
from mimose_cli.planners.every_n import EveryN
from mimose_cli.planners.mimose import Mimose
from mimose_cli.planners.options import PLANNER_NAMES
from mimose_cli.planners.oracle import Oracle
from mimose_cli.planners.sublinear import Sublinear

PLANNERS = {
    "mimose": Mimose,
    "none": NoCheckpointing,
    "full": FullCheckpointing,
    "sublinear": Sublinear,
    "dtr": DTR,
    "oracle": Oracle,
    "hf-every-n": EveryN,
}
assert tuple(PLANNERS) == PLANNER_NAMES, "every planner has its options in planners.options"


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """Build a planner by name; unknown names raise ValueError listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return PLANNERS[name](model, budget, **kwargs)
