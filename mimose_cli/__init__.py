"""mimose: fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch."""

__version__ = "0.1.0"

_PLANNERS = ("Mimose", "Sublinear", "DTR", "FullCheckpointing", "NoCheckpointing", "Oracle",
             "Planner", "Decision", "StepInfo", "build_planner")


def __getattr__(name):
    # Lazy, so that `import mimose_cli` (the CLI) does not import torch.
    if name in _PLANNERS:
        from mimose_cli import planners

        return getattr(planners, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PLANNERS])
