"""Planners by name: ``PLANNERS`` maps each to its policy class (``planners.policy.Policy``), and
``build_planner`` makes the ``Planner`` that carries it out. A policy takes ``(parts,
**options)``, ``options`` being the fields of its ``planners.options`` dataclass (and, from code
only, a few more: DTR's ``cost_fn``)."""

from mimose_cli.planners.base import Planner, policy_options
from mimose_cli.planners.baselines.dtr import DTRPolicy
from mimose_cli.planners.baselines.every_n import EveryNPolicy
from mimose_cli.planners.baselines.full_offload import FullOffloadPolicy
from mimose_cli.planners.baselines.oracle import OraclePolicy
from mimose_cli.planners.baselines.sublinear import SublinearPolicy
from mimose_cli.planners.baselines.uniform import FullCheckpointingPolicy, NoCheckpointingPolicy
from mimose_cli.planners.mimose.policy import MimosePolicy
from mimose_cli.planners.options import PLANNER_NAMES

PLANNERS = {
    "mimose": MimosePolicy,
    "none": NoCheckpointingPolicy,
    "full": FullCheckpointingPolicy,
    "sublinear": SublinearPolicy,
    "dtr": DTRPolicy,
    "oracle": OraclePolicy,
    "hf-every-n": EveryNPolicy,
    "offload": FullOffloadPolicy,
}
assert tuple(PLANNERS) == PLANNER_NAMES, "every planner has its options in planners.options"


def library_keywords(name: str) -> set:
    """Planner ``name``'s own options: its policy's constructor keywords, the recipe's and those
    only code can pass (DTR's ``cost_fn``, a function)."""
    return policy_options(PLANNERS[name])


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """``Planner(model, PLANNERS[name], budget, **kwargs)``; unknown names raise ValueError
    listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return Planner(model, PLANNERS[name], budget, **kwargs)
