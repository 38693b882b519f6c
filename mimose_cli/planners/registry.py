"""Planners by name. Each takes ``(model, budget, *, blocks, safety_margin, meter, **options)``,
``options`` being the fields of its ``planners.options`` dataclass."""

import inspect

from mimose_cli.planners.base import FullCheckpointing, NoCheckpointing, Planner
from mimose_cli.planners.dtr import DTR
from mimose_cli.planners.every_n import EveryN
from mimose_cli.planners.mimose import Mimose
from mimose_cli.planners.offload import FullOffload
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
    "offload": FullOffload,
}
assert tuple(PLANNERS) == PLANNER_NAMES, "every planner has its options in planners.options"


# What every planner is given by its caller (the loop, fit_budget), never as one of its options.
_GIVEN = frozenset({"self", "model", "budget", "blocks", "safety_margin", "meter"})


def library_keywords(name: str) -> set:
    """Planner ``name``'s own constructor keywords, following ``**kwargs`` up its bases: the
    recipe's options and those only code can pass (DTR's ``cost_fn``, a function)."""
    found = set()
    for cls in PLANNERS[name].__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        found |= {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - _GIVEN
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return found


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """Build a planner by name; unknown names raise ValueError listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return PLANNERS[name](model, budget, **kwargs)
