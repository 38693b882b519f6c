"""mimose: fit PyTorch training into a GPU-memory budget by checkpointing just enough blocks per batch."""

__version__ = "0.1.0"
