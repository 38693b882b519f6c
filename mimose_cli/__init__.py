"""mimose: fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so that `import mimose_cli` (the CLI) does not import torch.
    if name == "Mimose":
        from mimose_cli.planners.mimose import Mimose

        return Mimose
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
