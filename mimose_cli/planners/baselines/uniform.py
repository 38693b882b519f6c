"""The two planners that treat every block alike: ``none`` (no block checkpointed: the speed
limit) and ``full`` (every block checkpointed: what Hugging Face's
``gradient_checkpointing_enable()`` does)."""

from mimose_cli.planners.base import Planner
from mimose_cli.planners.blocks import KEEP, RECOMPUTE, SELECTIVE, selectable
from mimose_cli.planners.contract import NO_CONTEXT, Decision, Policy


class NoCheckpointingPolicy(Policy):
    """Checkpoint nothing: the speed limit, and out of memory on large batches."""

    name = "none"
    adapts = False
    saves_memory = False

    def decide(self, input_size, context=NO_CONTEXT):
        return Decision((KEEP,) * self.parts.num_blocks)


class FullCheckpointingPolicy(Policy):
    """Checkpoint every block, as ``gradient_checkpointing_enable()`` does; ``selective``: keep
    each block's compute-heavy ops' outputs and recompute the rest (``blocks.SELECTIVE``)."""

    name = "full"
    adapts = False

    def __init__(self, parts):
        super().__init__(parts)
        self.selective = parts.options.selective
        if self.selective:
            held = next((name for (name, _), ok in zip(parts.blocks, selectable(parts.blocks)) if not ok), None)
            if held is not None:
                raise ValueError(f"planner.full.selective cannot checkpoint block {held} selectively: it holds buffers "
                                 "(BatchNorm statistics) that its recompute puts back, which torch's selective "
                                 "checkpointing refuses; set planner.full.selective: false")

    def decide(self, input_size, context=NO_CONTEXT):
        return Decision((SELECTIVE if self.selective else RECOMPUTE,) * self.parts.num_blocks)

    def least_memory(self) -> Decision:
        return self.decide(())


def NoCheckpointing(model, budget=None, **options) -> Planner:
    """``Planner(model, NoCheckpointingPolicy, budget, **options)``."""
    return Planner(model, NoCheckpointingPolicy, budget, **options)


def FullCheckpointing(model, budget=None, **options) -> Planner:
    """``Planner(model, FullCheckpointingPolicy, budget, **options)`` (``selective=True``: selectively)."""
    return Planner(model, FullCheckpointingPolicy, budget, **options)
