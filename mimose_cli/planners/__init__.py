"""The planners (the library's policy wing), three households: the framework here (the policy
contract ``contract``, the ``Planner`` that carries a policy out ``base``, its parts, the router
and runners, block discovery, the registry of options), Mimose's internals in ``mimose/`` and the
baselines in ``baselines/`` (which may use Mimose's estimator; Mimose uses no baseline).

``from mimose_cli.planners import Mimose, build_planner`` works as before; the names are read
lazily so that ``planners.options`` (what a recipe validates) is importable without torch.
"""

import importlib

_EXPORTS = {
    "PLANNERS": "registry", "build_planner": "base",
    "Decision": "contract", "Policy": "contract", "StepContext": "contract", "StepInfo": "contract",
    "Planner": "base", "PlannerParts": "parts", "infer_input_size": "inputs",
    "BlockRunner": "runners", "PlanRunner": "runners", "discover_blocks": "blocks",
    "FullCheckpointing": "baselines.uniform", "NoCheckpointing": "baselines.uniform",
    "FullCheckpointingPolicy": "baselines.uniform", "NoCheckpointingPolicy": "baselines.uniform",
    "DTR": "baselines.dtr", "DTRPolicy": "baselines.dtr", "EveryN": "baselines.every_n",
    "EveryNPolicy": "baselines.every_n", "FullOffload": "baselines.full_offload",
    "FullOffloadPolicy": "baselines.full_offload", "Oracle": "baselines.oracle", "OraclePolicy": "baselines.oracle",
    "Sublinear": "baselines.sublinear", "SublinearPolicy": "baselines.sublinear",
    "Mimose": "mimose.policy", "MimosePolicy": "mimose.policy",
    "RankOutOfMemoryError": "recovery", "ProbesDiverged": "sharding",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"mimose_cli.planners.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
