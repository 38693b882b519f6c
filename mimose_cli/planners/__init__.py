"""The planners (the library's policy wing): Mimose and the baselines, one contract (``base``).

``from mimose_cli.planners import Mimose, build_planner`` works as before; the names are read
lazily so that ``planners.options`` (what a recipe validates) is importable without torch.
"""

import importlib

_EXPORTS = {
    "PLANNERS": "registry", "build_planner": "registry",
    "Decision": "base", "FullCheckpointing": "base", "NoCheckpointing": "base", "Planner": "base",
    "StepInfo": "base", "BlockRunner": "blocks", "PlanRunner": "blocks", "discover_blocks": "blocks",
    "DTR": "dtr", "EveryN": "every_n", "FullOffload": "offload", "Mimose": "mimose", "Oracle": "oracle",
    "Sublinear": "sublinear",
    "infer_input_size": "inputs",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"mimose_cli.planners.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
