"""The planners (the library's policy wing): Mimose and the baselines, each a policy (``policy``)
carried out by one ``Planner`` (``base``).

``from mimose_cli.planners import Mimose, build_planner`` works as before; the names are read
lazily so that ``planners.options`` (what a recipe validates) is importable without torch.
"""

import importlib

_EXPORTS = {
    "PLANNERS": "registry", "build_planner": "registry",
    "Decision": "policy", "FullCheckpointing": "base", "NoCheckpointing": "base", "Planner": "base",
    "FullCheckpointingPolicy": "base", "NoCheckpointingPolicy": "base", "Policy": "policy",
    "PlannerParts": "parts", "StepContext": "policy", "StepInfo": "policy",
    "BlockRunner": "blocks", "PlanRunner": "blocks", "discover_blocks": "blocks",
    "DTR": "dtr", "DTRPolicy": "dtr", "EveryN": "every_n", "EveryNPolicy": "every_n", "FullOffload": "offload",
    "FullOffloadPolicy": "offload", "Mimose": "mimose", "MimosePolicy": "mimose", "Oracle": "oracle",
    "OraclePolicy": "oracle", "Sublinear": "sublinear", "SublinearPolicy": "sublinear",
    "infer_input_size": "inputs",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"mimose_cli.planners.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
