"""Planners by name. Each takes ``(model, budget, *, blocks, safety_margin, meter, **options)``."""

import inspect
from typing import Literal, get_args, get_origin

from mimose_cli.planners.base import Decision, FullCheckpointing, NoCheckpointing, Planner, StepInfo
from mimose_cli.planners.blocks import BlockRunner, PlanRunner, discover_blocks
from mimose_cli.planners.dtr import DTR
from mimose_cli.planners.inputs import infer_input_size
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


# What every planner is given by the training loop, never by the recipe's planner.options.
_FROM_RECIPE = frozenset({"self", "model", "budget", "blocks", "safety_margin", "meter"})


def _option_params(name: str) -> dict:
    """Planner ``name``'s keyword options (``planner.options``) as {name: inspect.Parameter},
    following ``**kwargs`` up its base classes."""
    found = {}
    for cls in PLANNERS[name].__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        for p in params:
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in _FROM_RECIPE:
                found.setdefault(p.name, p)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return found


def option_problem(name: str, options: dict) -> tuple | None:
    """(key, value, what was expected) for the first of ``options`` that planner ``name`` does
    not take, or whose value is not among the ``Literal`` choices its constructor annotates."""
    params = _option_params(name)
    for key, value in options.items():
        if key not in params:
            takes = f"an option of {name}: {', '.join(params)}" if params else f"no options ({name} takes none)"
            return key, value, takes
        annotation = params[key].annotation
        choices = get_args(annotation) if get_origin(annotation) is Literal else ()
        if choices and value not in choices:
            return key, value, " | ".join(map(str, choices))
    return None


def build_planner(name: str, model, budget=None, **kwargs) -> Planner:
    """Build a planner by name; unknown names raise ValueError listing the choices."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(sorted(PLANNERS))}")
    return PLANNERS[name](model, budget, **kwargs)


__all__ = ["PLANNERS", "BlockRunner", "DTR", "Decision", "FullCheckpointing", "Mimose", "NoCheckpointing",
           "Oracle", "PlanRunner", "Planner", "StepInfo", "Sublinear", "build_planner", "discover_blocks",
           "infer_input_size", "option_problem"]
