"""mimose: fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch.

The library's names are read lazily, so that ``import mimose_cli`` (the CLI) does not import torch::

    planner = mimose_cli.Mimose(model, budget="6GB")     # your own loop
    mimose_cli.fit_budget(trainer, "6GB")                # a Hugging Face Trainer
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("Mimose", "Sublinear", "DTR", "EveryN", "FullCheckpointing", "NoCheckpointing", "Oracle",
                     "FullOffload", "Planner", "Policy", "PlannerParts", "Decision", "StepContext", "StepInfo",
                     "build_planner"), "mimose_cli.planners"),
    "fit_budget": "mimose_cli.launcher.hf_trainer",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
